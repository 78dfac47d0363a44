import pytest
import torch

from cifar_baselines.schedule import lr_at, warmup_step_lr


def test_lr_schedule_warmup_and_steps():
    assert lr_at(0, 0.1, 5, (160, 180)) == pytest.approx(0.02)
    assert lr_at(2.5, 0.1, 5, (160, 180)) == pytest.approx(0.07)
    assert lr_at(5, 0.1, 5, (160, 180)) == pytest.approx(0.1)
    assert lr_at(159.9, 0.1, 5, (160, 180)) == pytest.approx(0.1)
    assert lr_at(160, 0.1, 5, (160, 180)) == pytest.approx(0.01)
    assert lr_at(199, 0.1, 5, (160, 180)) == pytest.approx(0.001)
    assert lr_at(0, 0.1, 0, (160, 180)) == pytest.approx(0.1)


def test_warmup_step_lr_runs_lr_at_per_iteration():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = warmup_step_lr(opt, steps_per_epoch=4, warmup_epochs=2, milestones=[3, 4], gamma=0.1)
    seen = []
    for _ in range(20):  # what each iteration runs at, then the handler's step after it
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([lr_at(k / 4, 0.1, 2, [3, 4], 0.1) for k in range(20)])
    assert seen[0] == pytest.approx(0.05) and seen[8] == pytest.approx(0.1) and seen[-1] == pytest.approx(0.001)
