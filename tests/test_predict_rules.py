"""The selective policy's rule in a prediction, white-box: ``offload._predict.selective_rule.SelectiveRule``
is not re-exported by the package (the public API's owners decide that), so rules of a user's own
are built from it here; named rules go through ``predict(selective_rule="...")`` as users pass them.

Oracle: the same fake step's FLOP and byte counts, split otherwise: what a rule re-runs is priced at
the roofline times the built-in rule's stash leaves out, byte for byte and op for op.
"""

from __future__ import annotations

import pytest
import torch

import offload
from offload._predict.selective_rule import BUILT_IN, TORCHTITAN_OP, SelectiveRule
from offload.models import GPTConfig, MiniGPT


class _Linears(torch.nn.Module):
    """One region of five bias-free linears (five aten.mm, one shape) with a GELU between each: the
    first four outputs are saved inside the region (a stash holds only outputs saved before the
    region's last save), the fifth is the region's output."""

    def __init__(self) -> None:
        super().__init__()
        layers = [m for _ in range(4) for m in (torch.nn.Linear(64, 64, bias=False), torch.nn.GELU())]
        layers.append(torch.nn.Linear(64, 64, bias=False))
        self.blocks = torch.nn.ModuleList([torch.nn.Sequential(*layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _block(rule) -> object:
    model = _Linears().to(torch.bfloat16)
    x = torch.randn(2, 32, 64, dtype=torch.bfloat16, requires_grad=True)
    prediction = offload.predict(
        model, x, machine="h100-sxm", regions=model.blocks, selective_rule=rule, budgets=(1.0,)
    )
    return prediction.regions[1]


def test_the_n_th_matmuls_are_re_run_and_priced_at_their_own_time():
    nothing = _block(SelectiveRule(name="none saved", saved_ops=frozenset()))
    matmuls = _block(SelectiveRule(name="mm saved", saved_ops=frozenset({"mm"})))
    second = _block(SelectiveRule(name="every 2nd", saved_ops=frozenset({"mm"}), every_nth_matmul_recomputed=2))
    assert (nothing.expensive_tensors, matmuls.expensive_tensors, second.expensive_tensors) == (0, 4, 2)
    assert nothing.cheap_ms == pytest.approx(nothing.forward_ms)  # every op of the forward re-run
    one_mm_ms = (nothing.cheap_ms - matmuls.cheap_ms) / 5  # the five mm, one shape
    assert one_mm_ms > 0
    assert second.cheap_ms == pytest.approx(matmuls.cheap_ms + 2 * one_mm_ms)  # the 2nd and the 4th re-run
    one_output = matmuls.expensive_bytes // 4
    assert second.expensive_bytes == 2 * one_output
    assert nothing.cheap_bytes > second.cheap_bytes > matmuls.cheap_bytes  # what re-runs is dropped
    assert matmuls.forward_flops == second.forward_flops == nothing.forward_flops  # the same counts


def test_the_built_in_rule_is_the_default_and_the_engines_own():
    with torch.device("meta"):
        model = MiniGPT(GPTConfig(n_layer=2, n_embd=256, n_head=4, seq_len=256)).to(torch.bfloat16)
    tokens = torch.zeros(1, 256, dtype=torch.long, device="meta")
    default = offload.predict(model, tokens, tokens, machine="h100-sxm")
    named = offload.predict(model, tokens, tokens, machine="h100-sxm", selective_rule="built-in")
    given = offload.predict(model, tokens, tokens, machine="h100-sxm", selective_rule=BUILT_IN)
    assert default.regions == named.regions == given.regions and default.points == given.points
    assert default.selective.startswith("selective re-runs each region's cheap ops")
    titan = offload.predict(model, tokens, tokens, machine="h100-sxm", selective_rule="torchtitan-op")
    assert titan.selective.startswith("selective re-runs by the rule torchtitan-op: saves")
    assert "every 2-th matmul re-run anyway" in str(titan) and "torchtitan" in titan.to_dict()["selective"]
    for block, titan_block in zip(default.regions[1:-1], titan.regions[1:-1], strict=True):
        assert titan_block.cheap_ms > block.cheap_ms  # it re-runs matmuls the built-in rule keeps
        assert titan_block.expensive_bytes < block.expensive_bytes
    assert TORCHTITAN_OP.every_nth_matmul_recomputed == 2 and "mm" in TORCHTITAN_OP.saved_ops


def test_a_bad_rule_names_the_value_and_the_fix():
    with pytest.raises(ValueError, match="every_nth_matmul_recomputed must be 0 .* got 1"):
        SelectiveRule(name="x", saved_ops=frozenset({"mm"}), every_nth_matmul_recomputed=1)
    with pytest.raises(ValueError, match="got True"):
        SelectiveRule(name="x", every_nth_matmul_recomputed=True)
    with pytest.raises(ValueError, match=r"\['not_an_op'\] are not aten ops"):
        SelectiveRule(name="x", saved_ops=frozenset({"mm", "not_an_op"}))
    with pytest.raises(TypeError, match="takes aten op names"):
        SelectiveRule(name="x", saved_ops="mm")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown selective rule 'titan'; named rules are: built-in, torchtitan-op"):
        _block("titan")
    with pytest.raises(TypeError, match="selective_rule= takes a SelectiveRule"):
        _block(3)


def test_the_predict_command_takes_a_rule(tmp_path, capsys):
    from offload.__main__ import main

    argv = ["predict", "--layers", "2", "--width", "64", "--heads", "4", "--vocab", "256", "--seq", "64"]
    argv += ["--out", str(tmp_path)]
    assert main(argv + ["--selective-rule", "torchtitan-op"]) == 0
    assert "selective re-runs by the rule torchtitan-op" in capsys.readouterr().out
    assert main(argv + ["--selective-saves", "mm,addmm", "--selective-every-matmul", "3"]) == 0
    assert "the rule given: saves addmm, mm; every 3-th matmul" in capsys.readouterr().out
    assert main(argv + ["--selective-every-matmul", "2"]) == 2
    assert "goes with --selective-saves" in capsys.readouterr().err
    assert main(argv + ["--selective-rule", "torchtitan-op", "--selective-saves", "mm"]) == 2
    assert "pass one of them" in capsys.readouterr().err


def test_a_rule_of_ones_own_runs_an_out_overload_as_a_re_run_op():
    """As the built-in rule does (``_regions.selective.is_expensive``): an ``out=`` overload writes
    into a tensor the caller made, so it is re-run, never stashed."""
    rule = SelectiveRule(name="mm", saved_ops=frozenset({"mm"}))
    assert rule.saves(torch.ops.aten.mm.default, 1) and not rule.saves(torch.ops.aten.mm.out, 1)
    assert not rule.saves(torch.ops.aten.addmm.default, 0)
