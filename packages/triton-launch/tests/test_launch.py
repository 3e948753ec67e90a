"""llmsys.triton_launch.launch against the ordinary Triton launch."""

import pytest
import torch
import triton
import triton.language as tl

from llmsys.triton_launch import kernel_path, launch, native, runs_under_interpreter
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


# --- the C launcher (native_launch.c) -------------------------------------------------------------


def test_the_c_launcher_packs_each_kind_as_the_driver_reads_it():
    import struct

    module = native.get()
    assert module is not None, "the C launcher did not build on this machine"
    x = torch.randn(3)
    packed = module.pack(b"pi-lIfdbL", x, -5, 7, 2**40, 2**32 - 1, 1.5, 2.25, True, 2**64 - 1)
    expected = (x.data_ptr(), -5, 2**40, 2**32 - 1, 1.5, 2.25, 1, 2**64 - 1, 0, 0)
    assert packed == struct.pack("<QiqIfdbQQQ", *expected)  # then the two scratch pointers
    with pytest.raises(ValueError, match="2 kinds for 1 arguments"):
        module.pack(b"pi", x)
    with pytest.raises(ValueError, match="unknown kind 'z'"):
        module.pack(b"z", 1)
    with pytest.raises(TypeError):
        module.pack(b"i", "not an int")


def test_the_c_key_follows_tritons_specialization():
    module = native.get()
    x = torch.randn(8)
    key = module.key(("head",), (x, x[1:], 1, 32, 7, 2**40, 2.5, True), {"BLOCK": 4})
    # an int: 16 + 4 * (== 1) + 2 * (% 16 == 0) + (fits in 32 bits)
    assert key == (
        "head",
        (torch.float32, True),
        (torch.float32, False),
        21,
        19,
        17,
        18,
        float,
        True,
        4,
    )
    assert module.key((), (x, None), {}) is None  # keyed in Python (launcher._python_key)
    assert module.key((), (2**70,), {}) is None


def test_the_kinds_of_a_compiled_signature():
    class Meta:
        num_ctas, launch_cooperative_grid, launch_pdl = 1, False, False
        global_scratch_size, profile_scratch_size, shared = 0, 0, 1024

    class Src:
        def __init__(self):
            self.signature = {"x": "*fp32", "n": "i32", "m": "i64", "f": "fp32", "B": "constexpr"}

    class Compiled:
        metadata, src = Meta(), Src()

    assert native.kinds(Compiled()) == b"pilf-"
    Compiled.src.signature = {"x": "*fp32", "d": "tensordesc<fp16[64, 64]>"}
    assert native.kinds(Compiled()) is None  # Triton's launcher builds the descriptor
    Compiled.src.signature = {"x": "*fp32"}
    Meta.global_scratch_size = 128
    assert native.kinds(Compiled()) is None


@pytest.mark.gpu
@pytest.mark.parametrize("native_launch", [True, False], ids=["c launcher", "triton launcher"])
def test_both_launchers_compute_the_same_on_every_path(native_launch, monkeypatch):
    if not native_launch:
        monkeypatch.setattr(native, "get", lambda: None)
        _compiled.clear()
    for n in (1, 13, 4096, 100_003):
        x = torch.randn(n, device="cuda")
        for view in (x, x[1:]):
            for _ in range(2):  # the first call compiles, the second takes the cached entry
                torch.testing.assert_close(run(view), view * 3.0 + 1)
    x = torch.randn(5, 70, device="cuda")
    for _ in range(2):
        out = torch.full_like(x, float("nan"))
        launch(add_rows, (5, 3), (x, out, 70, 70), {"BLOCK": 32}, num_warps=2)
        torch.testing.assert_close(out, x + torch.arange(5.0, device="cuda")[:, None])
    entries = [entry for key, entry in _compiled.items() if key[0] is scale_add]
    assert all((entry[1] is not None) == native_launch for entry in entries)
    _compiled.clear()


def test_host_grid_arithmetic_agrees_with_tritons():
    from llmsys.triton_launch import cdiv, next_power_of_2

    for n in range(1, 2**13 + 2):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
    for a in range(0, 200):
        for b in (1, 2, 3, 16, 64, 127, 128):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
    assert next_power_of_2(0) == 1


def test_the_c_launch_keys_a_cuda_call_as_python_does_and_leaves_the_rest_to_python():
    """The C entry on a stand-in CUDA tensor (this machine may have no GPU): a miss returns the
    key Python builds, a cached entry goes to the driver, and every call it does not cover
    returns None for launcher.py to handle."""
    module = native.get()

    class CudaLike:  # what the C launcher reads of a tensor: get_device, dtype, data_ptr
        dtype = torch.float16

        def __init__(self, address):
            self.address = address

        def get_device(self):
            return 0

        def data_ptr(self):
            return self.address

    hooks = triton.knobs.runtime.launch_enter_hook
    module.init(CudaLike, lambda: 0, lambda device: 0, triton.knobs.runtime)
    try:
        x, cache = CudaLike(4096), {}
        args, constexprs, options = (x, CudaLike(4100), 7, 2.5), {"BLOCK": 64}, {"fp": False}
        key = module.launch(cache, scale_add, (3, 2), args, constexprs, 4, None, options)
        head = (scale_add, 0, 4, None, ("fp", False))
        assert key == module.key(head, args, constexprs)
        assert key[len(head) : len(head) + 2] == ((torch.float16, True), (torch.float16, False))
        cache[key] = (None, b"ppif-", 128, 0, 0)  # a compiled kernel: the driver is called
        try:  # with no function: no libcuda on this machine, or the driver refuses it
            returned = module.launch(cache, scale_add, (3, 2), args, constexprs, 4, None, options)
        except RuntimeError as error:
            assert "native_launch" in str(error)
        else:  # no current CUDA context on this thread: the key, for Triton's launcher
            assert returned == key
        cache[key] = (None, None, 128, 0, 0)  # a kernel for Triton's launcher: the key again
        assert module.launch(cache, scale_add, 3, args, constexprs, 4, None, options) == key
        for grid in (0, -1, (), (1, 2, 3, 4), (2, 0), 2.0, [3]):
            assert module.launch(cache, scale_add, grid, args, constexprs, 4, None, {}) is None
        cpu = (torch.zeros(4), *args[1:])
        assert module.launch(cache, scale_add, 3, cpu, constexprs, 4, None, {}) is None
        hooks.add(print)
        try:
            assert module.launch(cache, scale_add, 3, args, constexprs, 4, None, {}) is None
        finally:
            hooks.remove(print)
        with pytest.raises(TypeError, match=r"native_launch\.launch"):
            module.launch(cache, scale_add, 3, args, constexprs, 4, None)
    finally:
        native.get.cache_clear()
        native.get()  # initialized again with torch's tensor type and functions
