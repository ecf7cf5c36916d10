"""The GPT in one process: shapes, causality, tying, learning, deterministic init.

A world of one needs no process group: `Comm` skips groups of size 1. Layouts
with tp or pp > 1 are built (not run) to check what each rank's shard holds."""

import pytest
import torch

from trainer.batch import IGNORE_INDEX, MicroBatch
from trainer.comm import Comm
from trainer.config import JobConfig, ModelConfig, OptimConfig
from trainer.engine import TrainEngine
from trainer.model import GPTStage, full_init
from trainer.parallel_dims import ParallelDims

CFG = ModelConfig(layers=3, d_model=32, heads=4, seq_len=16)
SEED = 11


def build(*, cfg=CFG, seed=SEED, dp=1, tp=1, pp=1, rank=0) -> GPTStage:
    dims = ParallelDims(dp=dp, tp=tp, pp=pp, sp=False, nodes=1, rank=rank, world_size=dp * tp * pp)
    return GPTStage(cfg, comm=Comm(dims, device=torch.device("cpu")), sp=False, seed=seed)


def tokens(batch=2, seq=16, seed=0) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_shapes_and_ignored_targets():
    model = build()
    ids = tokens()
    assert model(ids).shape == (2, 16, CFG.vocab_size)
    targets = tokens(seed=1)
    targets[:, 10:] = IGNORE_INDEX
    loss = model(ids, targets)
    assert loss.shape == (2, 16) and loss.dtype == torch.float32
    assert torch.all(loss[:, 10:] == 0) and torch.all(loss[:, :10] > 0)
    full = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
                                             reduction="none")
    torch.testing.assert_close(loss.flatten(), full)


def test_attention_is_causal():
    """Changing tokens at positions >= 9 leaves every earlier position's logits alone;
    this is also why right padding needs no attention mask."""
    model = build()
    ids = tokens()
    changed = ids.clone()
    changed[:, 9:] = (changed[:, 9:] + 17) % CFG.vocab_size
    a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=0)
    assert not torch.allclose(a[:, 9:], b[:, 9:])


def test_head_is_tied_to_the_token_embedding():
    model = build()
    vocab_sized = [n for n, p in model.named_parameters() if CFG.vocab_size in p.shape]
    assert vocab_sized == ["embed.weight"]  # no separate head matrix
    # a token that is only ever a target gets an embedding grad: through the head
    ids = torch.full((1, 16), 5)
    targets = torch.full((1, 16), 7)
    model(ids, targets).sum().backward()
    grad = model.embed.weight.grad
    assert grad[7].abs().sum() > 0 and grad[5].abs().sum() > 0 and grad[9].abs().sum() > 0
    # logits are exactly hidden @ embedding^T
    with torch.no_grad():
        h = model.embed_tokens(ids)
        for block in model.layers.values():
            h = block(h)
        want = (model.final_ln(h) @ model.embed.weight.t()).transpose(0, 1)
        torch.testing.assert_close(model(ids), want)


def test_loss_decreases_on_a_fixed_batch():
    cfg = JobConfig(model=CFG, optim=OptimConfig(lr=3e-3, warmup_steps=1), steps=8, seed=SEED)
    dims = ParallelDims(dp=1, tp=1, pp=1, sp=False, nodes=1, rank=0, world_size=1)
    engine = TrainEngine(cfg, dims, Comm(dims, device=torch.device("cpu")), torch.device("cpu"))
    ids = tokens(batch=4, seq=17)
    targets = ids[:, 1:].clone()
    targets[0, 12:] = IGNORE_INDEX
    mbs = [MicroBatch(inputs=ids[:, :-1], targets=targets, num_tokens=int((targets != IGNORE_INDEX).sum()))]
    losses = [engine.train_step(step, mbs, mbs[0].num_tokens).loss for step in range(1, 9)]
    assert losses[0] == pytest.approx(torch.log(torch.tensor(float(CFG.vocab_size))).item(), rel=0.02)
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < losses[0] - 0.5


def test_init_depends_only_on_seed_and_name():
    model = build()
    for name, param in model.named_parameters():
        want = full_init(name, list(param.shape), param.init, seed=SEED, std=CFG.init_std, num_layers=CFG.layers)
        torch.testing.assert_close(param.detach(), want, rtol=0, atol=0)
    other = build(seed=SEED + 1)
    assert not torch.equal(model.layers["1"].attn.qkv.weight, other.layers["1"].attn.qkv.weight)
    assert not torch.equal(model.layers["0"].mlp.fc.weight, model.layers["1"].mlp.fc.weight)


def test_every_layout_holds_slices_of_the_same_weights():
    full = dict(build().named_parameters())
    # tp=2, rank 1: the second half of column-parallel rows / row-parallel columns
    shard = dict(build(tp=2, rank=1).named_parameters())
    assert set(shard) == set(full)
    for name, param in shard.items():
        ref = full[name]
        if param.tp_dim is not None:
            n = param.shape[param.tp_dim]
            ref = ref.narrow(param.tp_dim, n, n)
        torch.testing.assert_close(param, ref, rtol=0, atol=0)
    # qkv shard keeps whole heads: rank 1 holds heads 2 and 3 with their q, k and v
    head_dim = CFG.d_model // CFG.heads
    qkv = full["layers.0.attn.qkv.weight"].view(CFG.heads, 3, head_dim, CFG.d_model)
    torch.testing.assert_close(shard["layers.0.attn.qkv.weight"].view(2, 3, head_dim, CFG.d_model), qkv[2:])
    # pp=2: stage 0 holds layers 0-1 and the embeddings, stage 1 layer 2, final LN and a tied copy
    first = dict(build(pp=2, rank=0).named_parameters())
    last = dict(build(pp=2, rank=1).named_parameters())
    assert {n.split(".")[1] for n in first if n.startswith("layers.")} == {"0", "1"}
    assert {n.split(".")[1] for n in last if n.startswith("layers.")} == {"2"}
    assert "pos_embed" in first and "final_ln.weight" not in first and "final_ln.weight" in last
    assert last["embed.weight"].tied_copy and not first["embed.weight"].tied_copy
    for name, param in [*first.items(), *last.items()]:
        torch.testing.assert_close(param, full[name], rtol=0, atol=0)
