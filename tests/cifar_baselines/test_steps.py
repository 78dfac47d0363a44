import pytest
import torch
from ignite.engine import Events
from monai.engines import SupervisedEvaluator, SupervisedTrainer

from cifar_baselines import steps
from cifar_baselines.batches import BatchIterator
from cifar_baselines.resnet import resnet32
from cifar_baselines.steps import EvalStep, TrainStep, autocast_for, predict


@pytest.fixture
def batches():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (24, 3, 32, 32), dtype=torch.uint8, generator=g)
    return x, torch.arange(24) % 10


def test_cpu_amp_is_bf16_for_training_only_and_only_with_native_bf16(monkeypatch):
    cpu = torch.device("cpu")
    for native in (True, False):
        monkeypatch.setattr(steps, "cpu_has_native_bf16", lambda native=native: native)
        assert autocast_for(cpu, True, training=True)[1] == (torch.bfloat16 if native else torch.float32)
        assert autocast_for(cpu, True, training=False)[1] == torch.float32  # evaluation stays float32
        assert autocast_for(cpu, False, training=True)[1] == torch.float32


def test_eval_logits_are_float32_even_where_training_runs_bf16(monkeypatch, batches):
    """ECE and TS must see float32 logits: neither ``predict`` nor the evaluator's step autocasts."""
    monkeypatch.setattr(steps, "cpu_has_native_bf16", lambda: True)  # CPU training would be bf16
    x, y = batches
    torch.manual_seed(0)
    net = resnet32().to(memory_format=torch.channels_last)
    logits = predict(net, x, batch_size=10)
    assert logits.dtype == torch.float32
    ev = SupervisedEvaluator("cpu", BatchIterator(x, y, 10, sampler="sequential"), net, epoch_length=3,
                             iteration_update=EvalStep(), decollate=False)
    preds = []
    ev.add_event_handler(Events.ITERATION_COMPLETED, lambda e: preds.append(e.state.output["pred"]))
    ev.run()
    assert all(p.dtype == torch.float32 for p in preds)
    ref = net.eval()(steps.prepare_images(x).float())  # plain float32 forward
    torch.testing.assert_close(torch.cat(preds), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)


def test_predict_features(batches):
    x, _ = batches
    m = resnet32(10)
    logits, feats = predict(m, x, features=True, batch_size=7)
    assert feats.shape == (24, 64)
    torch.testing.assert_close(m.head(feats), logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mixup_alpha", [0.0, 1.0])
def test_train_step_in_a_supervised_trainer(batches, mixup_alpha):
    x, y = batches
    torch.manual_seed(0)
    net = resnet32().to(memory_format=torch.channels_last)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    outs = []
    trainer = SupervisedTrainer("cpu", 1, BatchIterator(x, y, 8), net, opt, torch.nn.CrossEntropyLoss(),
                                epoch_length=3, iteration_update=TrainStep(mixup_alpha=mixup_alpha, amp=False),
                                decollate=False)
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: outs.append(e.state.output))
    trainer.run()
    assert len(outs) == 3 and all(o["loss"].dtype == torch.float32 and o["loss"].ndim == 0 for o in outs)
    assert all(o["label"].dtype == torch.long and o["pred"].shape == (8, 10) for o in outs)  # un-mixed labels
    assert any(not torch.equal(before[k], v) for k, v in net.state_dict().items() if k.endswith("weight"))


def test_non_finite_loss_says_what_to_do(batches):
    x, y = batches
    net = resnet32()
    trainer = SupervisedTrainer("cpu", 1, BatchIterator(x, y, 8), net, torch.optim.SGD(net.parameters(), lr=0.1),
                                lambda logits, target: logits.sum() * float("nan"), epoch_length=3,
                                iteration_update=TrainStep(amp=False, channels_last=False), decollate=False)
    with pytest.raises(FloatingPointError, match="learning rate"):
        trainer.run()


@pytest.mark.parametrize("mixup_alpha", [0.0, 1.0])
def test_train_step_feeds_the_network_what_its_batch_method_makes(batches, mixup_alpha):
    """``TrainStep.batch`` is the step's own input pipeline (``experiments/precision_check.py`` relies on it):
    a second step with the same seed, called on the same uint8 batches, reproduces every input and target."""
    x, y = batches
    data = list(BatchIterator(x, y, 8))
    seen = []

    def loss(logits, target):
        seen.append(target.clone())
        return torch.nn.functional.cross_entropy(logits, target)

    net = resnet32().to(memory_format=torch.channels_last)
    outs = []
    trainer = SupervisedTrainer("cpu", 1, data, net, torch.optim.SGD(net.parameters(), lr=0.01), loss,
                                epoch_length=3, decollate=False,
                                iteration_update=TrainStep(mixup_alpha=mixup_alpha, amp=False, seed=3))
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: outs.append(e.state.output["image"]))
    trainer.run()
    replay = TrainStep(mixup_alpha=mixup_alpha, amp=False, seed=3)
    for (xb, yb), image, target in zip(data, outs, seen):
        x_ref, t_ref = replay.batch(xb, yb)
        torch.testing.assert_close(image, x_ref, atol=0, rtol=0)
        torch.testing.assert_close(target, t_ref, atol=0, rtol=0)
        assert x_ref.is_contiguous(memory_format=torch.channels_last)
        assert t_ref.shape == ((8, 10) if mixup_alpha else (8,))
    other = TrainStep(mixup_alpha=mixup_alpha, amp=False, seed=4).batch(*data[0])[0]
    assert not torch.equal(other, outs[0])  # the seed matters: the replay is not trivially equal
