"""`h3-spark inspect`'s output: one report per partition, and an --out that cannot hold reports."""

import pytest

from h3_spark.cli import main
from h3_spark.h3_model.checkpoint.make import make_dit_checkpoint
from h3_spark.h3_model.dit.config import TINY


@pytest.fixture(scope="module")
def two_partitions(tmp_path_factory):
    models = tmp_path_factory.mktemp("inspect_cli") / "models"
    make_dit_checkpoint(models / "transformer", TINY, "bf16", "diffusers", seed=1)
    make_dit_checkpoint(models / "transformer_ref", TINY, "bf16", "diffusers", seed=2)
    return models


def test_each_partition_gets_its_own_report(two_partitions, tmp_path, capsys):
    # One folder, two DiTs: the ref2va report once replaced the t2va one under the same name.
    for partition in ("t2va", "ref2va"):
        assert main(["inspect", str(two_partitions), "--partition", partition, "--out", str(tmp_path)]) == 0
        assert f"models.{partition}.inspect.json" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models.ref2va.inspect.json", "models.t2va.inspect.json"]


def test_without_a_partition_the_name_is_unchanged(two_partitions, tmp_path, capsys):
    assert main(["inspect", str(two_partitions / "transformer"), "--out", str(tmp_path)]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["transformer.inspect.json"]


@pytest.mark.parametrize("out", ["afile", "afile/reports"])
def test_out_through_a_file_is_one_line(two_partitions, tmp_path, capsys, out):
    (tmp_path / "afile").write_text("")
    code = main(["inspect", str(two_partitions / "transformer"), "--out", str(tmp_path / out)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert f"{tmp_path / 'afile'} is a file; --out names the folder for the report" in err
