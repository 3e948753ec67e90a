"""The test environments' torch stays a CPU build where one can be had: the command lines
torch_base builds, the reachability probe, and the CUDA-build check (no network needed)."""

import time

from llmsys_dev import envs


def test_with_the_cpu_index_torch_is_searched_there_beside_pips_own_index(tmp_path):
    command = envs.torch_install_command(
        ["torch==2.13.0", "triton==3.9.0"], tmp_path, cpu_index=True
    )
    at = command.index("--extra-index-url")
    assert command[at + 1] == "https://download.pytorch.org/whl/cpu"
    assert "--index-url" not in command  # pip's own index still serves triton
    assert command[-2:] == ["torch==2.13.0", "triton==3.9.0"]
    assert command[command.index("--target") + 1] == str(tmp_path)


def test_without_the_cpu_index_the_plain_install_names_no_index(tmp_path):
    command = envs.torch_install_command(["torch==2.13.0"], tmp_path, cpu_index=False)
    assert not any(part.startswith("--") and "index" in part for part in command)
    assert command[-1] == "torch==2.13.0"


def test_an_index_that_does_not_answer_is_given_up_at_once():
    started = time.perf_counter()
    assert not envs.cpu_index_reachable("http://127.0.0.1:9/whl/cpu", timeout=2)  # discard port
    assert time.perf_counter() - started < 5


def test_a_cuda_build_is_told_from_a_cpu_build(tmp_path):
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch-2.13.0+cpu.dist-info").mkdir()
    assert not envs.has_cuda_build(tmp_path)
    (tmp_path / "nvidia" / "cudnn").mkdir(parents=True)
    assert envs.has_cuda_build(tmp_path)
    cuda = tmp_path / "other"
    (cuda / "torch-2.13.0+cu130.dist-info").mkdir(parents=True)
    assert envs.has_cuda_build(cuda)
