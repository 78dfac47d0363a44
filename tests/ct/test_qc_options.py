"""``lungcal qc`` and ``lungcal predict`` set the series-check thresholds the same way (issue 35 item 7).

One option, ``--set NAME=VALUE`` (repeatable), registered and read by one pair of functions
(:func:`lungcal.ct.commands.add_qc_options`, :func:`~lungcal.ct.commands.qc_config`); ``predict`` also keeps
the older ``--qc JSON`` (a JSON object, a JSON file, or a bundle's ``qc`` section), under ``--set``.
"""
from __future__ import annotations

import json

import pytest

from lungcal.cli import build_parser, main
from lungcal.ct.commands import qc_config, qc_settings
from lungcal.ct.qc import QCConfig
from lungcal.errors import ConfigError

SETS = ["--set", "max_slice_thickness_mm=3.5", "--set", "min_slices=8", "--set", "derived=fail"]


def _args(*argv: str):
    return build_parser().parse_args(list(argv))


def test_qc_and_predict_take_the_same_set_option():
    qc = _args("qc", "ct.nii.gz", *SETS)
    predict = _args("predict", "ct.nii.gz", "--run", "abc", *SETS)
    want = QCConfig(max_slice_thickness_mm=3.5, min_slices=8, derived="fail")
    assert qc_config(qc) == qc_config(predict) == want
    assert isinstance(qc_config(qc).min_slices, int)
    assert qc_config(_args("qc", "ct.nii.gz")) == qc_config(_args("predict", "x", "--run", "r")) == QCConfig()


def test_one_parser_registers_both():
    def set_action(argv):
        parser = build_parser()
        sub = next(a for a in parser._actions if a.dest == "command").choices[argv[0]]
        return next(a for a in sub._actions if a.dest == "set")

    qc, predict = set_action(["qc"]), set_action(["predict"])
    assert (qc.help, qc.metavar, type(qc)) == (predict.help, predict.metavar, type(predict))
    with pytest.raises(SystemExit):  # the older JSON form is predict's alone (kept for its scripts)
        _args("qc", "ct.nii.gz", "--qc", "{}")


def test_the_older_qc_json_still_works_under_set(tmp_path):
    section = {"_target_": "lungcal.ct.qc.QCConfig", "max_slice_thickness_mm": 6.0, "warn_slice_thickness_mm": 6.0}
    path = tmp_path / "qc.json"
    path.write_text(json.dumps(section))
    for given in (json.dumps(section), str(path)):  # a bundle's section as it is, inline or in a file
        assert qc_config(_args("predict", "x", "--run", "r", "--qc", given)) == \
            QCConfig(max_slice_thickness_mm=6.0, warn_slice_thickness_mm=6.0)
    both = _args("predict", "x", "--run", "r", "--qc", '{"max_slice_thickness_mm": 6.0, "min_slices": 4}',
                 "--set", "min_slices=8")
    assert (qc_config(both).max_slice_thickness_mm, qc_config(both).min_slices) == (6.0, 8)  # --set wins


@pytest.mark.parametrize("items, legacy, message", [
    (["thickness=2"], None, "bad --set 'thickness=2'"),
    (["max_slice_thickness_mm=thin"], None, "--set max_slice_thickness_mm needs a float"),
    ([], "{not json", "--qc is neither a JSON object nor a JSON file"),
    ([], "[3.5]", "--qc must be a JSON object"),
])
def test_bad_thresholds_name_the_option_and_the_fix(items, legacy, message):
    with pytest.raises(ConfigError) as err:
        qc_settings(items, legacy)
    assert message in str(err.value) and "Fix: " in str(err.value) and "--set " in str(err.value).split("Fix: ")[1]


def test_predict_refuses_a_bad_set_in_one_line_before_anything_loads(tmp_path, capsys):
    code = main(["predict", str(tmp_path / "none.nii.gz"), "--run", "0" * 32, "--output-dir", str(tmp_path),
                 "--set", "max_slice_thickness_mm=2", "--set", "warn_slice_thickness_mm=2.5"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "qc.warn_slice_thickness_mm (2.5) must not exceed qc.max_slice_thickness_mm (2.0)" in err
    assert not any(tmp_path.iterdir())


def test_recalibrate_and_site_check_take_the_same_set_and_refuse_a_bad_one_before_anything_loads(tmp_path, capsys):
    for cmd in (["recalibrate", "--model", "0" * 32, "--datalist", str(tmp_path / "site.json")],
                ["site-check", str(tmp_path / "site.json"), "--run", "0" * 32]):
        code = main([*cmd, "--output-dir", str(tmp_path), "--set", "max_slice_thickness_mm=2",
                     "--set", "warn_slice_thickness_mm=2.5"])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "must not exceed qc.max_slice_thickness_mm (2.0)" in err
    assert not any(tmp_path.iterdir())
