"""The plan covers the whole step: what is saved outside the regions is measured, shown, counted
and decided with them.

A language model saves its largest tensors after its last block: the LM head's logits and the
loss's log-softmax, batch x sequence x vocabulary. Oracle for the sizes: the store's own count of
the step, split at the blocks' boundaries by forward hooks; for the decisions: the budget held
(the engine's peak against it) and the gradients of the model without the engine.
"""

from __future__ import annotations

import pytest
import torch

import offload
from offload import Scope
from offload.models.gpt import GPTConfig, MiniGPT
from test_regions import MACHINE, assert_same_history
from zoo import most_profiling_steps

CONFIG = GPTConfig(n_layer=3, n_head=2, n_embd=64, seq_len=64, dropout=0.1, vocab_size=4096, attention="math")
BATCH = 4


def make_model() -> MiniGPT:
    torch.manual_seed(0)
    return MiniGPT(CONFIG)


def train(model, eng=None, steps: int = 5):
    history = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        idx = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.seq_len + 1), generator=g)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1234 + step)
        if eng is None:
            _, loss = model(idx[:, :-1], idx[:, 1:])
        else:
            with eng:
                _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        history.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    return history


def split_of_one_step() -> tuple[int, list[int], int]:
    """(before, per block, after) bytes as the store counts them, split at the blocks by hooks."""
    model = make_model()
    eng = offload.engine(None, model=model, min_offload_mb=0)
    marks, per_block = [], []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda m, a: marks.append(eng.stats.saved_bytes))
        block.register_forward_hook(lambda m, a, o: per_block.append(eng.stats.saved_bytes - marks[-1]))
    idx = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.seq_len + 1))
    with eng:
        _, loss = model(idx[:, :-1], idx[:, 1:])
        before = marks[0]
        last_end = marks[-1] + per_block[-1]
    total = eng.stats.saved_bytes
    del loss
    eng.close()
    return before, per_block, total - last_end


def engine(model, budget_mb, spill_dir, policy="auto"):
    return offload.engine(
        budget_mb,
        regions=model.blocks,
        model=model,
        policy=policy,
        machine=MACHINE,
        spill_dir=spill_dir,
        min_offload_mb=0,
    )


def test_the_saves_outside_the_regions_are_measured_and_shown(spill_dir):
    before, per_block, after = split_of_one_step()
    assert after > max(per_block), "the premise: the head's and the loss's saves are the largest"
    model = make_model()
    eng = engine(model, None, spill_dir, policy="offload")
    train(model, eng, steps=2)
    plan = eng.plan
    outside = {r.scope: r for r in plan.outside}
    assert outside[Scope.BEFORE].saved_bytes == before
    assert outside[Scope.AFTER].saved_bytes == after
    assert [r.saved_bytes for r in plan.regions] == per_block
    text = offload.explain(eng)
    assert "(after the regions)" in text and "(before the regions)" in text
    assert "a loss computed in chunks" in text
    keep_peak = plan.predicted_peak_bytes
    assert keep_peak == before + sum(per_block) + after, "a plan that keeps everything counts everything"
    eng.close()


@pytest.mark.parametrize("policy", ["auto", "offload"])
def test_a_budget_below_the_heads_saves_moves_them_and_holds(policy, spill_dir):
    """A budget smaller than what the step saves after its last block: the plan moves those saves
    (the only way to fit), the engine copies them out as they are made, and the step holds the
    budget with the gradients of the model without the engine.

    "As they are made": the final norm's saves, the first after the last block, have all started
    their copy out when the norm returns, though the store holds far less than the budget then
    (ordinary eviction would keep them, and move saves only once the logits overflow it)."""
    _, per_block, after = split_of_one_step()
    budget_mb = 0.8 * after / 2**20
    steps = most_profiling_steps(policy) + 2  # the plan in force for the last two at least
    reference = train(make_model(), steps=steps)
    model = make_model()
    eng = engine(model, budget_mb, spill_dir, policy=policy)
    at_last_block_end: list[offload.Stats] = []
    after_norm: list[tuple[offload.Stats, offload.Stats]] = []  # (at the last block's end, at the norm's)
    model.blocks[-1].register_forward_hook(lambda m, a, o: at_last_block_end.append(eng.stats))
    model.norm_f.register_forward_hook(lambda m, a, o: after_norm.append((at_last_block_end[-1], eng.stats)))
    history = []
    peaks = []
    for step in range(steps):
        eng.reset_stats()
        history += train_one(model, eng, step)
        peaks.append(eng.stats.peak_resident_bytes)
    assert_same_history(history, reference, f"{policy} with the head's saves moved")
    plan = eng.plan
    assert plan.decision_after() is offload.Decision.OFFLOAD, str(plan)
    assert plan.fits_budget, str(plan)
    stages = list(eng.recent_stages)
    assert stages[-1] is None
    assert peaks[-1] <= budget_mb * 2**20, (peaks, str(plan))
    checked = 0
    for stage, (block_end, norm_end) in zip(stages, after_norm, strict=True):
        if stage is not None:
            continue  # a profiling step measures; only a plan's OFFLOAD sends saves out eagerly
        saved = norm_end.saved_bytes - block_end.saved_bytes
        sent = norm_end.offloaded_bytes - block_end.offloaded_bytes
        assert saved > 0, "the premise: the final norm saves"
        if block_end.resident_bytes + saved > budget_mb * 2**20:
            continue  # no room for them: ordinary eviction would move them too, so this tells nothing
        assert sent == saved, f"every save after the last block leaves as it is made: {sent} of {saved} bytes"
        checked += 1
    # Where the plan keeps a block (auto, on trials that price a keep as cheapest), the kept bytes
    # can fill the budget, and no step can tell eager sending from eviction; otherwise every
    # planned step is checked.
    keeps = any(d is offload.Decision.KEEP for d in plan.decisions)
    assert checked > 0 or keeps, (stages, str(plan))
    eng.close()


def train_one(model, eng, step):
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.seq_len + 1), generator=g)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234 + step)
    with eng:
        _, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    out = [(loss.detach(), [p.grad.clone() for p in model.parameters()])]
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    return out


@pytest.mark.parametrize("policy", ["auto", "offload"])
def test_explain_says_what_the_store_does_with_the_saves_before_the_regions(policy, spill_dir):
    """At budget 0 the store moves every save, those before the first region included (the oldest,
    evicted first): the plan says so, and its peak fits, as the engine's own peak does (See Note:
    [the saves outside the regions, as the store treats them])."""
    before, _, _ = split_of_one_step()
    assert before > 0, "the premise: the embedding saves before the first block"
    model = make_model()
    eng = engine(model, 0, spill_dir, policy=policy)
    train(model, eng, steps=4)
    outside = {r.scope: r for r in eng.plan.outside}
    assert outside[Scope.BEFORE].decision is offload.Decision.OFFLOAD, str(eng.plan)
    assert eng.plan.fits_budget and eng.plan.predicted_peak_bytes == 0, str(eng.plan)
    assert eng.stats.peak_resident_bytes == 0
    assert "OVER BUDGET" not in offload.explain(eng)
    eng.close()


def test_explain_says_the_store_holds_a_budget_that_selective_decisions_exceed(spill_dir):
    """Policy "selective" decides whatever the budget: at budget 0 its regions' inputs and stash add up
    over it, but the store moves them off the device as they are made and holds the budget (the
    measured peak). ``explain`` says that, not "OVER BUDGET"."""
    model = make_model()
    eng = engine(model, 0, spill_dir, policy="selective")
    train(model, eng, steps=4)
    text = offload.explain(eng)
    assert not eng.plan.fits_budget and eng.stats.peak_resident_bytes == 0, text
    assert "OVER BUDGET" not in text and "the store moves the oldest saves beyond the budget" in text, text
    eng.close()


def test_the_saves_before_the_regions_stay_where_the_budget_has_room(spill_dir):
    before, per_block, after = split_of_one_step()
    model = make_model()
    eng = engine(model, 4 * (before + sum(per_block) + after) / 2**20, spill_dir)
    train(model, eng, steps=4)
    outside = {r.scope: r for r in eng.plan.outside}
    assert outside[Scope.BEFORE].decision is offload.Decision.KEEP, str(eng.plan)
    assert eng.stats.offloaded_bytes == 0
    eng.close()


class Gapped(torch.nn.Module):
    """Blocks with a tanh between each two: its saves fall between the regions, outside all of them."""

    def __init__(self, width: int = 64, blocks: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(width, width)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU()) for _ in range(blocks)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for i, block in enumerate(self.blocks):
            if i:
                x = torch.tanh(x)
            x = block(x)
        return x.square().mean()


def test_the_saves_between_regions_count_with_those_before_them(spill_dir):
    """What is saved between two regions is neither region's: the plan's "before the regions" row
    holds it with what was saved before the first (See Note: [the saves outside the regions, as the
    store treats them]); the store's own count of one step, split by hooks, is the oracle."""
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    model = Gapped()
    counting = offload.engine(None, model=model, min_offload_mb=0)
    starts, ends = [], []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda m, a: starts.append(counting.stats.saved_bytes))
        block.register_forward_hook(lambda m, a, o: ends.append(counting.stats.saved_bytes))
    with counting:
        loss = model(x)
    gaps = [start - end for start, end in zip(starts[1:], ends, strict=False)]
    before = starts[0] + sum(gaps)
    del loss
    counting.close()
    assert starts[0] > 0 and all(gap > 0 for gap in gaps), "the premise: saves before and between the blocks"

    model = Gapped()
    eng = offload.engine(
        None,
        regions=model.blocks,
        model=model,
        policy="offload",
        machine=MACHINE,
        spill_dir=spill_dir,
        min_offload_mb=0,
    )
    for _ in range(2):
        with eng:
            loss = model(x)
        loss.backward()
    plain = Gapped()
    plain(x).backward()
    plain(x).backward()
    for got, want in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(got.grad, want.grad), "the gradients of the model without the engine"
    outside = {r.scope: r for r in eng.plan.outside}
    assert outside[Scope.BEFORE].saved_bytes == before, (outside[Scope.BEFORE].saved_bytes, starts[0], gaps)
    eng.close()


class Critic(torch.nn.Module):
    """A WGAN critic: a stack of wide blocks and a scalar score (no vocabulary, no logits)."""

    def __init__(self, width: int = 256, depth: int = 3) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()) for _ in range(depth)
        )
        self.score = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.score(x)


def _critic_steps(critic: Critic, eng=None, steps: int = 4) -> list[torch.Tensor]:
    """WGAN-GP critic steps: the score gap plus the gradient penalty, whose graph (the critic's
    backward, made with ``create_graph=True``) is saved after the last block's forward."""
    history = []
    for step in range(steps):
        torch.manual_seed(step)
        real, fake = torch.randn(64, 256), torch.randn(64, 256)
        mix = torch.rand(64, 1)
        with eng if eng is not None else torch.enable_grad():
            gap = critic(fake).mean() - critic(real).mean()
            x_hat = (mix * real + (1 - mix) * fake).requires_grad_(True)
            (grad,) = torch.autograd.grad(critic(x_hat).sum(), x_hat, create_graph=True)
            loss = gap + 10 * ((grad.norm(dim=1) - 1) ** 2).mean()
        loss.backward()
        history += [loss.detach(), *(p.grad.clone() for p in critic.parameters())]
        with torch.no_grad():
            for p in critic.parameters():
                p -= 1e-3 * p.grad
                p.grad = None
    return history


def test_a_gradient_penalty_graph_is_not_advised_as_an_lm_head(spill_dir):
    """The saves after a critic's last block are its gradient penalty's graph, made during a
    backward: ``explain`` says so, with no word of an LM head's logits (which the step has none of).
    Training is bitwise that of the critic without the engine."""
    torch.manual_seed(0)
    reference_critic = Critic()
    critic = Critic()
    critic.load_state_dict(reference_critic.state_dict())
    reference = _critic_steps(reference_critic)
    eng = offload.engine(
        None, regions=critic.blocks, model=critic, policy="offload", machine=MACHINE, spill_dir=spill_dir
    )
    history = _critic_steps(critic, eng)
    text = offload.explain(eng)
    eng.close()
    for i, (got, want) in enumerate(zip(history, reference, strict=True)):
        assert torch.equal(got, want), f"tensor {i} (losses and gradients, step by step) differs"
    after = next(r for r in eng.plan.outside if r.scope is Scope.AFTER)
    assert after.saved_bytes > max(r.saved_bytes for r in eng.plan.regions), "the premise: the penalty saves most"
    assert "LM head" not in text and "gradient penalty" in text, text


def test_the_after_row_of_a_step_whose_backward_never_ran(spill_dir):
    """A profiling forward whose backward never runs is measured when the next step begins: its
    "after" row ends where that forward left the engine, not at the next step's first region (the
    next step's embedding is no save of its). Oracle: the store's split of one step; the step
    that follows trains as the model without the engine does."""
    before, _, after = split_of_one_step()
    model, reference = make_model(), make_model()
    eng = engine(model, None, spill_dir, policy="offload")
    idx = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.seq_len + 1), generator=torch.Generator().manual_seed(7))
    with eng:
        _, dropped = model(idx[:, :-1], idx[:, 1:])
    del dropped  # its backward never runs
    assert_same_history(train(model, eng, steps=1), train(reference, steps=1), "the step after")
    first = eng.profiled_steps[0]
    assert first.stage == "measure"
    rows = {r.scope: r.saved_bytes for r in first.outside}
    assert rows == {Scope.BEFORE: before, Scope.AFTER: after}
    eng.close()


WIDTH = 64


class _TableBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x, table):
        return torch.tanh(self.lin(x)) * table[: x.shape[0]]  # a view of the table, saved by the product


class _Tabled(torch.nn.Module):
    """A table made in the forward before the blocks, viewed inside each (a rotary table, a mask)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(_TableBlock() for _ in range(3))
        self.head = torch.nn.Linear(WIDTH, 1)

    def forward(self, x):
        table = torch.linspace(0.5, 1.5, 512 * WIDTH).view(512, WIDTH)
        for block in self.blocks:
            x = block(x, table)
        return self.head(x).sum()


def _tabled_split(batch: int) -> list[int]:
    """Bytes per block as the store counts one step (a storage it holds already counts no more)."""
    model = _Tabled()
    eng = offload.engine(None, model=model, min_offload_mb=0)
    starts, per_block = [], []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda m, a: starts.append(eng.stats.saved_bytes))
        block.register_forward_hook(lambda m, a, o: per_block.append(eng.stats.saved_bytes - starts[-1]))
    with eng:
        loss = model(torch.randn(batch, WIDTH, generator=torch.Generator().manual_seed(batch)))
    del loss
    eng.close()
    return per_block


def test_a_table_made_before_the_regions_counts_once_in_a_recompute_trial(spill_dir):
    """A "recompute" trial at a second shape counts what its re-run regions would save by the
    store's rules (See Note: [sizes a recompute trial counts]): the table's storage in the first
    block that views it, not again in each block. Oracle: the store's own split of one step."""
    model, reference = _Tabled(), _Tabled()
    eng = offload.engine(budget_mb=0, model=model, regions=model.blocks, policy="auto", min_offload_mb=0)
    batches = [64] * most_profiling_steps("auto") + [128]
    for step, batch in enumerate(batches):
        x = torch.randn(batch, WIDTH, generator=torch.Generator().manual_seed(batch))
        with eng:
            loss = model(x)
        loss.backward()
        reference(x).backward()
        for got, want in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(got.grad, want.grad), f"step {step}: the gradients of the model without the engine"
            got.grad = want.grad = None
    trial = eng.profiled_steps[-1]
    assert trial.stage == "recompute" and trial.inputs[0][0] == (128, WIDTH), eng.recent_stages
    split = _tabled_split(128)
    assert split[0] > split[1] == split[2], "the premise: the first block holds the table"
    assert [r.saved_bytes for r in trial.regions] == split
    eng.close()
