"""`llmsys-bench train --quick` on 2 gloo ranks: every strategy trains the tiny Llama, one row
each, and the losses match single-process training on the same tokens.

What equality to expect: every rank trains on the same batch, so the data-parallel gradient
(the mean of equal gradients) is one process's gradient on that batch. The strategies that
train float32 weights under bf16 autocast (one-gpu, the DDPs, the ZeROs) then follow a single
process doing the same to rounding (1e-5: the all-reduce's sum and division by 2 are exact on
equal values; the optimizer's sharding changes no arithmetic). The FSDPs compute in bf16 by
their own policies, not by autocast (weights cast before the matmul, norms kept or cast), so
their losses differ by bf16 rounding: within 5e-3 of a loss near ln(256) = 5.5 over 2 steps.
"""

import math

import pytest
import torch

from llmsys.bench_harness import results
from llmsys.profiling import cli, train
from llmsys.profiling.llama import TINY, build_llama
from llmsys.profiling.train_strategies import STRATEGIES

pytest.importorskip(
    "transformers", reason="transformers is an optional extra: llmsys-profiling[transformers]"
)

AUTOCAST_TOLERANCE = 1e-5
SHARDED_TOLERANCE = 5e-3  # fsdp, fsdp2: their own bf16 policies against autocast's


def quick_run(rank: int, world_size: int, out: str) -> None:
    cli.main(["train", "--quick", "--device", "cpu", "--out", out])


def single_process_losses(steps: int) -> list[float]:
    """The reference: one process, the same seeded weights and batch, AdamW with the
    documented settings, bf16 autocast, the loss from ``labels=``."""
    torch.manual_seed(0)
    model = build_llama(TINY, "cpu", torch.float32).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    data = torch.randint(0, TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=data, labels=data, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_quick_run_on_two_gloo_ranks_trains_as_one_process(run_ranks, tmp_path):
    run_ranks(quick_run, world_size=2, timeout=120, out=str(tmp_path))
    rows = {r.provider: r for r in results.read_rows(tmp_path / "train.csv")}
    assert list(rows) == list(STRATEGIES)  # one-gpu first, then every strategy, one row each
    for name, row in rows.items():
        assert row.kernel == "train/tiny" and row.mode == "eager, no ckpt", row
        assert row.x == "tiny seq16 b2/rank x2", row
        assert math.isfinite(row.p50) and row.p50 > 0, row
        assert row.throughput == pytest.approx(2 * 16 / (row.p50 / 1e3)), row
        assert "predicted peak" in row.config and "final loss" in row.config, row
        if name != "one-gpu":
            assert "exposed communication" in row.config, row
    assert rows["one-gpu"].speedup_vs_baseline == pytest.approx(1.0)
    curves: dict[str, list[float]] = {}
    for record in results.read_csv(tmp_path / "train-loss.csv"):
        curves.setdefault(record["strategy"], []).append(float(record["loss"]))
    expected = single_process_losses(steps=2)
    for name, losses in curves.items():
        tolerance = AUTOCAST_TOLERANCE if STRATEGIES[name].autocast else SHARDED_TOLERANCE
        assert losses == pytest.approx(expected, abs=tolerance), name
    assert (tmp_path / "train.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (ValueError("FSDP refuses this model"), "failed: ValueError: FSDP refuses this model"),
        (torch.OutOfMemoryError("CUDA out of memory"), "out of memory"),
    ],
)
def test_a_strategy_that_fails_gets_a_row_saying_why(monkeypatch, tmp_path, error, status):
    def refuse(name, model, device):
        raise error

    monkeypatch.setattr(train.train_strategies, "build", refuse)
    args = cli.build_parser().parse_args(["train", "--quick", "--device", "cpu"])
    setup = train.Setup.from_args(args)
    data = torch.zeros(2, 16, dtype=torch.long)
    measured = train.measure_or_say_why("fsdp", setup, data, torch.device("cpu"), True)
    assert measured["status"] == status and math.isnan(measured["times_ms"][0])
    baseline = {**measured, "times_ms": [10.0], "status": "", "losses": [5.0]}
    rows = train.rows_for({"one-gpu": baseline, "fsdp": measured}, setup, 2, torch.device("cpu"))
    assert rows[1].config.startswith(status) and rows[1].throughput is None
    assert "| fsdp |" in train.details_table(rows)


def test_quick_defaults_and_what_is_given_wins():
    args = cli.build_parser().parse_args(["train", "--quick", "--steps", "3"])
    setup = train.Setup.from_args(args)
    assert (setup.name, setup.seq_len, setup.batch_size, setup.steps) == ("tiny", 16, 2, 3)
    full = train.Setup.from_args(
        cli.build_parser().parse_args(["train", "--checkpointing", "full"])
    )
    assert (full.name, full.seq_len, full.batch_size, full.mode) == (
        "8b",
        8192,
        1,
        "eager, full ckpt",
    )


@pytest.mark.parametrize("tied", [False, True])
def test_the_llama_accounting_counts_the_built_models_parameters(tied):
    """``from_llama`` and ``llama_forward_flops`` against the model transformers builds: its
    parameter count, and 2 FLOPs per token and matmul weight (all but the embedding's lookup and
    the norms' gains) plus causal attention's."""
    from llmsys.profiling.infra import accounting, memory_model

    sizes = TINY | dict(tie_word_embeddings=tied)
    model = build_llama(sizes, "cpu", torch.float32)
    params = sum(p.numel() for p in model.parameters())
    assert memory_model.from_llama(sizes).num_params == params
    d, layers, vocab = sizes["hidden_size"], sizes["num_hidden_layers"], sizes["vocab_size"]
    matmul = params - (0 if tied else vocab * d) - (2 * layers + 1) * d
    batch, seq, heads = 2, 16, sizes["num_attention_heads"]
    attention = layers * 2 * 2 * batch * heads * seq * (seq + 1) / 2 * (d // heads)
    expected = 2 * batch * seq * matmul + attention
    assert accounting.llama_forward_flops(sizes, batch, seq) == pytest.approx(expected)
