"""llmsys.triton_launch.launch against the ordinary Triton launch."""

import pytest
import torch
import triton
import triton.language as tl

from llmsys.triton_launch import kernel_path, launch, runs_under_interpreter
from llmsys.triton_launch.launcher import _compiled, _key


@triton.jit
def scale_add(x_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * alpha + 1, mask=mask)


def run(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    out = torch.full_like(x, float("nan"))
    launch(scale_add, triton.cdiv(x.numel(), block), (x, out, x.numel(), 3.0), {"BLOCK": block})
    return out


@pytest.mark.parametrize("n", [1, 13, 64, 1000])
def test_matches_the_formula_on_odd_sizes(n, device):
    x = torch.randn(n, device=device)
    torch.testing.assert_close(run(x), x * 3.0 + 1)


def test_repeated_calls_and_misaligned_pointers_stay_correct(device):
    x = torch.randn(1001, device=device)
    for view in (x, x[1:], x, x[3:]):  # x[1:] is 4-byte aligned only: another specialization
        torch.testing.assert_close(run(view), view * 3.0 + 1)


def test_empty_grid_launches_nothing(device):
    x = torch.randn(0, device=device)
    out = torch.full((1,), float("nan"), device=device)
    launch(scale_add, 0, (x, out, 0, 3.0), {"BLOCK": 64})
    assert out.isnan().all()


def test_specialization_key_follows_triton():
    x = torch.randn(8)
    assert _key(x) == (torch.float32, True)
    assert _key(x[1:]) == (torch.float32, False)
    assert _key(1) == (True, False, True)
    assert _key(32) == (False, True, True)
    assert _key(2**31) == (False, True, False)
    assert _key(2.5) is _key(0.125) is float  # never specialized: one entry for all values
    assert _key(None) == (type(None), None)


@triton.jit
def add_rows(x_ptr, out_ptr, n_cols, stride, BLOCK: tl.constexpr):
    """out[row, :] = x[row, :] + row, a 2-D grid of (rows, column blocks)."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    values = tl.load(x_ptr + row * stride + cols, mask=mask)
    tl.store(out_ptr + row * stride + cols, values + row, mask=mask)


@pytest.mark.parametrize("num_stages", [None, 2])
def test_two_dimensional_grid_and_stages(num_stages, device):
    x = torch.randn(5, 70, device=device)
    for _ in range(2):  # the first call compiles, the second takes the cached kernel
        out = torch.full_like(x, float("nan"))
        grid = (x.shape[0], triton.cdiv(x.shape[1], 32))
        args = (x, out, x.shape[1], x.stride(0))
        launch(add_rows, grid, args, {"BLOCK": 32}, num_warps=2, num_stages=num_stages)
        torch.testing.assert_close(out, x + torch.arange(5.0, device=device)[:, None])


@pytest.mark.parametrize("grid", [(), (1, 1, 1, 1), -1, (2, -3)])
def test_grid_of_more_than_three_or_negative_sizes_is_refused(grid):
    x = torch.randn(4)
    out = torch.full_like(x, float("nan"))
    with pytest.raises(ValueError, match="`grid` must be 1 to 3 sizes, each at least 0"):
        launch(scale_add, grid, (x, out, 4, 1.0), {"BLOCK": 4})
    assert out.isnan().all()


@pytest.mark.parametrize("grid", [1.0, "4", (2, 1.5), True])
def test_grid_of_non_ints_is_refused(grid):
    x = torch.randn(4)
    with pytest.raises(TypeError, match="`grid` must be an int or a tuple of 1 to 3 ints"):
        launch(scale_add, grid, (x, x, 4, 1.0), {"BLOCK": 4})


def test_constexprs_out_of_signature_order_are_refused(device):
    x = torch.randn(5, 70, device=device)
    args = (x, torch.empty_like(x), 70, 70)
    with pytest.raises(ValueError, match="signature order"):
        launch(add_rows, (5, 3), args[:2], {"stride": 70, "n_cols": 70, "BLOCK": 32})  # swapped
    with pytest.raises(ValueError, match="signature order"):
        launch(scale_add, 1, (x, x, 4), {"BLOCK": 4})  # alpha is missing from args


def test_cpu_kernels_run_under_the_interpreter(device):
    assert runs_under_interpreter(scale_add) == (device == "cpu")


def test_kernel_path_names_the_path_a_package_takes(device):
    assert kernel_path(scale_add, "cuda") == "Triton kernel"
    interpreted = device == "cpu"  # the tests run the kernels under TRITON_INTERPRET=1 on a CPU
    expected = "Triton kernel under TRITON_INTERPRET=1" if interpreted else "eager fallback"
    assert kernel_path(scale_add, torch.device("cpu")) == expected
    assert kernel_path(scale_add.fn, "cpu") == "eager fallback"  # not decorated by the interpreter


@pytest.mark.gpu
def test_each_num_stages_gets_its_own_cache_entry():
    x = torch.randn(5, 70, device="cuda")
    args = (x, torch.empty_like(x), 70, 70)
    entries = []
    for num_stages in (2, 2, 3):
        launch(add_rows, (5, 3), args, {"BLOCK": 32}, num_warps=2, num_stages=num_stages)
        entries.append(sum(key[0] is add_rows for key in _compiled))
    assert entries[1] == entries[0] and entries[2] == entries[0] + 1


@pytest.mark.gpu
def test_second_call_uses_the_cached_kernel(monkeypatch):
    x = torch.randn(4096, device="cuda")
    run(x)
    calls = []
    monkeypatch.setattr(type(scale_add), "__getitem__", lambda *a: calls.append(a))
    torch.testing.assert_close(run(x), x * 3.0 + 1)
    assert calls == [] and any(key[0] is scale_add for key in _compiled)


@pytest.mark.gpu
def test_profiler_hooks_see_every_launch():
    x = torch.randn(4096, device="cuda")
    run(x)
    seen = []
    hooks = triton.knobs.runtime.launch_enter_hook
    hooks.add(seen.append)
    try:
        torch.testing.assert_close(run(x), x * 3.0 + 1)
    finally:
        hooks.remove(seen.append)
    assert len(seen) == 1


def test_host_grid_arithmetic_agrees_with_tritons():
    from llmsys.triton_launch import cdiv, next_power_of_2

    for n in range(1, 2**13 + 2):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
    for a in range(0, 200):
        for b in (1, 2, 3, 16, 64, 127, 128):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
    assert next_power_of_2(0) == 1
