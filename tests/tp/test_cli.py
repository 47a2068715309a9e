"""--tp outside mpirun, or with a world of another size, is a one-line error before any model loads."""
from __future__ import annotations

import os

import pytest

from pyfast import cli
from tests.models.test_hybrid_common import FIXTURES

MPI_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")


@pytest.mark.parametrize("cmd", [["generate", "-p", "hi", "-n", "1"], ["perplexity", "-f", __file__], ["serve"]])
def test_tp_without_mpirun_is_a_clear_error(cmd, capsys, monkeypatch):
    for k in MPI_VARS:
        monkeypatch.delenv(k, raising=False)
    rc = cli.main([cmd[0], "-m", str(FIXTURES / "qwen35.gguf"), "--tp", "2", *cmd[1:]])
    err = capsys.readouterr().err
    assert rc == 1 and "mpirun -np 2" in err and err.count("\n") == 1, err


def test_tp_one_is_the_plain_path(capsys):
    assert cli.main(["generate", "-m", str(FIXTURES / "qwen35.gguf"), "--tp", "1", "-p", "hi", "-n", "2", "--temp", "0",
                     "--raw", "-t", "1"]) == 0
