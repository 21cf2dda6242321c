"""kdlib.tp: the tensor-parallel engine on gloo (CPU ranks spawned with torch.multiprocessing).

Each spawned check runs `kdlib.engine.generate` (the one decode loop) on TPModel ranks and compares
rank 0's outputs with a single-process run: logits within fp32 tolerance, vocab-parallel top-K ids
exact and log-probs close, TP AR and TP DDTree tokens equal to single-process AR greedy, sampled
AR and DDTree (T > 0) equal to the single-process draws of the same seed; inside the ranks, debug
mode asserts that trees, paths and outputs are bit-identical across ranks. A child's failure must
surface here, not hang.
"""

import dataclasses
import types

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kdlib import DATA, zoo
from kdlib.engine import Model, ModelConfig
from kdlib.engine.batch import generate_batch
from kdlib.engine.model import MoE
from kdlib.perf.suites import tp as suite
from kdlib.tp import assert_replicated, check_tp_config, partition, shard_state_dict, spawn
from kdlib.tp.engine import TPModel, TPMoE, vocab_parallel_argmax, vocab_parallel_topk
from kdlib.tp.workers import (
    bench,
    bench_spec,
    check_spec,
    check_worker,
    compare,
    dense_topk,
    reference,
    run_check,
    synthetic_logits,
)

SPAWN_TIMEOUT_S = 60  # a tiny check takes ~5-15 s on 2 cores; a hung collective fails after this


def _cfg(name):
    return ModelConfig.from_json(DATA / "configs" / f"{name}.json")


@given(st.integers(1, 200), st.integers(1, 16))
def test_partition_covers_contiguously_and_evenly(n, world):
    if n < world:
        with pytest.raises(ValueError, match="cannot split"):
            partition(n, world)
        return
    parts = partition(n, world)
    assert parts[0][0] == 0 and parts[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:], strict=False))
    sizes = [hi - lo for lo, hi in parts]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_config_that_cannot_be_split_is_refused():
    with pytest.raises(ValueError, match="num_attention_heads"):
        check_tp_config(_cfg("tiny-b"), 4)  # 3 heads over 4 ranks
    with pytest.raises(ValueError, match="n_routed_experts"):
        check_tp_config(dataclasses.replace(_cfg("tiny-a"), n_routed_experts=2, n_group=1, topk_group=1), 4)
    with pytest.raises(ValueError, match="moe_mode"):
        check_tp_config(_cfg("tiny-a"), 2, moe_mode="dp")
    check_tp_config(_cfg("tiny-b"), 2, moe_mode="tp")  # uneven heads (2 + 1) are fine


@pytest.mark.parametrize("moe_mode", ["ep", "tp"])
def test_shards_reassemble_the_full_weights(moe_mode):
    """Concatenating the shards of 3 ranks (uneven: 4 heads, 96 vocab rows, 8 experts) gives back every
    tensor."""
    cfg = _cfg("tiny-a")
    full = Model.random(cfg, seed=3).state_dict()
    world = 3
    shards = [shard_state_dict(full, cfg, r, world, moe_mode) for r in range(world)]
    qk, nv, v = cfg.qk_head_dim, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.v_head_dim
    attn = "model.layers.1.self_attn."
    assert torch.equal(
        torch.cat([s[attn + "q_b_proj.weight"] for s in shards]), full[attn + "q_b_proj.weight"]
    )
    assert torch.equal(
        torch.cat([s[attn + "kv_b_proj.weight"] for s in shards]), full[attn + "kv_b_proj.weight"]
    )
    assert torch.equal(
        torch.cat([s[attn + "o_proj.weight"] for s in shards], 1), full[attn + "o_proj.weight"]
    )
    assert [s[attn + "q_b_proj.weight"].shape[0] // qk for s in shards] == [2, 1, 1]
    assert [s[attn + "kv_b_proj.weight"].shape[0] // nv for s in shards] == [2, 1, 1]
    assert [s[attn + "o_proj.weight"].shape[1] // v for s in shards] == [2, 1, 1]
    for s in shards:  # replicated: the latent projection (so the cache), norms, router, embedding
        for k in (
            attn + "kv_a_proj_with_mqa.weight",
            attn + "q_a_proj.weight",
            "model.layers.1.mlp.gate.weight",
            "model.embed_tokens.weight",
            "model.norm.weight",
        ):
            assert torch.equal(s[k], full[k])
    assert torch.equal(torch.cat([s["lm_head.weight"] for s in shards]), full["lm_head.weight"])
    dense = "model.layers.0.mlp."
    assert torch.equal(
        torch.cat([s[dense + "down_proj.weight"] for s in shards], 1), full[dense + "down_proj.weight"]
    )
    ex = "model.layers.2.mlp.experts."
    if moe_mode == "ep":
        got = [k for s in shards for k in sorted(s) if k.startswith(ex) and k.endswith("up_proj.weight")]
        assert len(got) == cfg.n_routed_experts  # every expert on exactly one rank
        # rank 2 owns 6, 7
        assert torch.equal(shards[2][ex + "0.up_proj.weight"], full[ex + "6.up_proj.weight"])
    else:
        for e in range(cfg.n_routed_experts):
            key = f"{ex}{e}.up_proj.weight"
            assert torch.equal(torch.cat([s[key] for s in shards]), full[key])


@pytest.mark.parametrize("change,moe_mode", [(dict(first_k_dense_replace=0, intermediate_size=1), "ep"),
                                             (dict(n_shared_experts=0, moe_intermediate_size=1), "ep")])
def test_a_dimension_the_config_does_not_use_need_not_split(change, moe_mode):
    """check_tp_config passed these; shard_state_dict still split the unused width (cannot split 1 item)."""
    cfg = dataclasses.replace(_cfg("tiny-a"), **change)
    check_tp_config(cfg, 2, moe_mode)
    full = Model.random(cfg, seed=0).state_dict()
    shards = [shard_state_dict(full, cfg, r, 2, moe_mode) for r in range(2)]
    key = "model.layers.0.self_attn.o_proj.weight"
    assert torch.equal(torch.cat([s[key] for s in shards], 1), full[key])


def test_check_spec_refuses_a_drafter_it_does_not_build():
    """('dflsh',) built no drafter, and every line of the comparison read ok."""
    for bad in (("dflsh",), "dflash"):
        with pytest.raises(ValueError, match="drafters must be a sequence of 'oracle' and 'dflash'"):
            check_spec(drafters=bad)


def test_vocab_parallel_argmax_compares_float64_maxima_whole():
    """The shards' maxima were gathered as float32: 10 and 10 + 1e-9 tied, and the tie went to rank 0."""
    logits = torch.zeros(1, 8, dtype=torch.float64)
    logits[0, 1], logits[0, 6] = 10.0, 10.0 + 1e-9  # rank 0 holds ids 0-3, rank 1 ids 4-7

    class Ranks:  # rank 0's view: its shard's values, then rank 1's from the queue
        def __init__(self):
            vals, idx = logits[:, 4:].max(dim=-1)
            self.others = [vals, idx + 4]

        def all_gather(self, x):
            return torch.stack([x, self.others.pop(0)])

    assert vocab_parallel_argmax(logits[:, :4], 0, Ranks()).tolist() == [int(logits.argmax())] == [6]


def test_from_model_refuses_int4_experts():
    model = Model.random(dataclasses.replace(_cfg("tiny-a"), moe_intermediate_size=32), seed=0)
    model.quantize_experts_int4()
    with pytest.raises(ValueError, match="INT4 experts are not supported under kdlib.tp"):
        TPModel.from_model(model, _TwoRanks(set()))


@pytest.mark.parametrize("moe_mode", ["ep", "tp"])
@pytest.mark.parametrize("tokens,path", [(1, "gather"), (6, "dense"), (40, "loop")])
def test_tp_moe_partial_sums_add_up_to_the_engine_moe_on_every_path(moe_mode, tokens, path, monkeypatch):
    """3 ranks' TPMoE partials (uneven shards) sum to the single-process MoE on each forward path, in
    float64."""
    cfg = dataclasses.replace(
        _cfg("tiny-a"), n_routed_experts=24, num_experts_per_tok=2, n_group=1, topk_group=1
    )
    monkeypatch.setattr(MoE, "DENSE_MAX_ROWS", 8 * cfg.n_routed_experts)  # 40 tokens take the loop
    model = Model.random(cfg, seed=0).double().eval()
    sd = model.state_dict()
    layer = next(i for i in range(cfg.num_hidden_layers) if isinstance(model.model.layers[i].mlp, MoE))
    full, prefix = model.model.layers[layer].mlp, f"model.layers.{layer}.mlp."
    x = torch.randn(tokens, cfg.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert full.path(tokens) == path
    total = torch.zeros_like(x)
    for rank in range(3):
        part = TPMoE(cfg, rank, 3, moe_mode).double().eval()
        shard = shard_state_dict(sd, cfg, rank, 3, moe_mode)
        part.load_state_dict({k[len(prefix):]: v for k, v in shard.items() if k.startswith(prefix)})
        with torch.no_grad():
            total += part(x)
    with torch.no_grad():
        want = full(x)
    assert torch.allclose(total, want, rtol=1e-12, atol=1e-12), float((total - want).abs().max())


# the engine's kdlib.ops verify attention (numpy reference on CPU) where the engine offers it
_OPS = "ops" if "ops" in getattr(Model, "ATTENTION", ()) else "torch"
CASES = [
    (1, {"config": "tiny-a", "moe_mode": "ep", "max_new": 8, "drafters": ("oracle",)}),  # a shard of all ids
    (2, {"config": "tiny-a", "moe_mode": "ep", "attention": _OPS, "max_new": 12, "drafters": ("oracle",)}),
    (2, {"config": "tiny-b", "moe_mode": "tp"}),  # 3 heads: an uneven 2 + 1 split; untied, no q_lora
    (4, {"config": "tiny-a", "moe_mode": "tp", "max_new": 16, "drafters": ("oracle",)}),
]
if zoo.available():
    CASES.append((2, {"zoo": True, "prompt_len": 24, "max_new": 16}))


@pytest.mark.parametrize(
    "world,params",
    CASES,
    ids=[
        f"w{w}-{p.get('config', 'zoo')}-{p.get('moe_mode', 'ep')}-{p.get('attention', 'torch')}"
        for w, p in CASES
    ],
)
def test_tp_gloo_equals_single_process(world, params, tmp_path):
    spec = check_spec(**params)
    out = tmp_path / "rank0.pt"
    spawn(check_worker, world, (spec, str(out)), timeout_s=SPAWN_TIMEOUT_S)
    got = torch.load(out)
    assert got["world"] == world
    lines = compare(got, reference(spec))
    assert not [x for x in lines if x.startswith("FAIL")], "\n".join(lines)
    assert any("DDTree" in x for x in lines)


def test_compare_catches_a_wrong_result():
    """The verdict is able to fail: a perturbed logit, a swapped top-k id and a changed token all show."""
    g = torch.Generator().manual_seed(0)
    ref = {
        "logits": torch.randn(5, 96, generator=g),
        "topk_ids": torch.arange(14).view(2, 7),
        "topk_logp": -torch.rand(2, 7, generator=g),
        "ar": [3, 1, 4, 1, 5],
        "ddtree:oracle": [3, 1, 4, 1, 5],
        "accepted:oracle": [2, 3],
        "sampled:ar": [2, 7, 1],
        "sampled:ddtree:oracle": [2, 7, 1],
    }
    same = {k: (v.clone() if isinstance(v, torch.Tensor) else list(v)) for k, v in ref.items()}
    assert not [x for x in compare(same, ref) if x.startswith("FAIL")]
    bad = {k: (v.clone() if isinstance(v, torch.Tensor) else list(v)) for k, v in ref.items()}
    bad["logits"][0, 0] += 1e-2
    bad["topk_ids"][0, [0, 1]] = bad["topk_ids"][0, [1, 0]]
    bad["ddtree:oracle"][-1] = 6
    bad["sampled:ddtree:oracle"][0] = 8
    fails = [x for x in compare(bad, ref) if x.startswith("FAIL")]
    assert len(fails) == 4, fails


def _rank1_raises(rank, world, device):
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # rank 0 waits in a collective for a peer that is gone


def test_child_failure_surfaces_instead_of_hanging():
    # either rank 1's own error or rank 0's "peer closed the connection", whichever is reported first
    with pytest.raises(Exception, match="boom on rank 1|Connection closed by peer|remote worker"):
        spawn(_rank1_raises, 2, timeout_s=SPAWN_TIMEOUT_S)


class _TwoRanks:
    """A stand-in for Comm whose all_gather returns rank 0's tensor and a second rank's: flipped bytes for
    the names in `differs`, a longer first dimension in the dtype-and-shape header (int64) for those in
    `reshaped`: assert_replicated's comparison without a process group."""

    world, rank, device = 2, 0, torch.device("cpu")

    def __init__(self, differs, reshaped=()):
        self.differs, self.reshaped, self.current = differs, reshaped, None

    def all_gather(self, x):
        other = x.clone()
        if x.dtype == torch.uint8 and self.current in self.differs:
            other[0] ^= 1
        if x.dtype == torch.int64 and self.current in self.reshaped:
            other[3] += 1
        return torch.stack([x, other])


def test_debug_assert_names_the_tensor_that_differs_across_ranks():
    comm = _TwoRanks({"visibility"})
    tensors = {"node_token_ids": torch.arange(5), "visibility": torch.eye(3, dtype=torch.bool),
               "top_logp": torch.randn(2, 3)}
    for name in tensors:  # one tensor at a time so the stand-in knows which one it is gathering
        comm.current = name
        if name == "visibility":
            with pytest.raises(RuntimeError, match="visibility differs between rank 0 and rank"):
                assert_replicated(comm, **{name: tensors[name]})
        else:
            assert_replicated(comm, **{name: tensors[name]})


def test_debug_assert_takes_empty_and_scalar_tensors():
    """An empty tree (budget 0: numpy arrays of shape [1, 0]) and 0-d values compare like the rest."""
    comm = _TwoRanks({"scalar"})
    assert_replicated(comm, empty=np.zeros((1, 0), dtype=np.int64)[:, ::1], flag=torch.tensor(True))
    comm.current = "scalar"
    with pytest.raises(RuntimeError, match="scalar differs"):
        assert_replicated(comm, scalar=torch.tensor(3))


def test_debug_assert_compares_shapes_before_bytes():
    """Rank 1 holding 5 tokens to rank 0's 4 aborted gloo (a byte count that differs cannot be gathered);
    [2, 3] against [3, 2] of the same bytes passed."""
    comm = _TwoRanks(set(), reshaped={"tokens"})
    comm.current = "tokens"
    with pytest.raises(RuntimeError, match=r"tokens: the dtype or shape differs between rank 0 and rank\(s\) "
                                           r"\[1\] \(rank 0's: torch.int64 \(2, 3\)\)"):
        assert_replicated(comm, tokens=torch.zeros(2, 3, dtype=torch.int64))


def test_vocab_shards_of_dense_logits_are_consistent():
    """The synthetic top-K rows hold ties in their last row: the reference breaks them to the lower id."""
    x = synthetic_logits(check_spec(), 96)
    ids, _ = dense_topk(x, 7)
    row = x[-1]
    vals = row[ids[-1]]
    for a, b, va, vb in zip(ids[-1][:-1], ids[-1][1:], vals[:-1], vals[1:], strict=True):
        assert va > vb or (va == vb and a < b)
    assert len(np.unique(row.numpy())) < row.numel()  # the row does hold ties


class _Ranks:
    """Comm of W simulated ranks for functions whose collectives' inputs depend on their local input alone:
    a first pass records what each rank gathers, call by call; the second returns every rank's."""

    def __init__(self, world):
        self.world, self.device, self.rank, self.calls = world, torch.device("cpu"), 0, {}
        self.replay, self.n = False, 0

    def all_gather(self, x):
        key, self.n = self.n, self.n + 1
        if not self.replay:
            self.calls.setdefault(key, {})[self.rank] = x.clone()
            return torch.stack([x] * self.world)
        return torch.stack([self.calls[key][r] for r in range(self.world)])

    def run(self, fn):
        for replay in (False, True):
            self.replay, out = replay, []
            for rank in range(self.world):
                self.rank, self.n = rank, 0
                out.append(fn(rank))
        return out


def test_vocab_parallel_topk_never_returns_its_padding():
    """A shard narrower than k is padded to k; with the padding's id -1 it won ties against real -inf
    logits (ids ascending), so fewer than k finite logits gave token -1 as a candidate."""
    V, W, k = 8, 2, 5
    logits = torch.full((1, V), float("-inf"))
    logits[0, 1], logits[0, 6] = 2.0, 1.0
    ranges = partition(V, W)
    comm = _Ranks(W)
    got = comm.run(lambda r: vocab_parallel_topk(logits[:, ranges[r][0]:ranges[r][1]], ranges[r][0], k, comm))
    want_ids, want_logp = dense_topk(logits, k)
    for ids, logp in got:
        assert ids.tolist() == want_ids.tolist() == [[1, 6, 0, 2, 3]]
        torch.testing.assert_close(logp, want_logp, rtol=1e-6, atol=0)  # the shards' lse: another rounding


def test_tp_refuses_what_it_does_not_run():
    """INT4 experts were accepted, then the next forward failed inside the float path (IndexError); the
    batched engine failed on a keyword; a world of 0 returned at once, having run nothing."""
    cfg = _cfg("tiny-a")
    with pytest.raises(ValueError, match="INT4 experts are not supported under kdlib.tp"):
        TPMoE(cfg, 0, 1, "ep").quantize_int4()
    for world in (0, -1, 1.0, True):
        with pytest.raises(ValueError, match="world must be an int >= 1"):
            spawn(_rank1_raises, world)
    comm = types.SimpleNamespace(rank=0, world=1, device=torch.device("cpu"), all_reduce=lambda x: x,
                                 all_gather=lambda x: x[None])
    tp = TPModel.from_model(Model.random(cfg, seed=0), comm, "ep")
    with pytest.raises(ValueError, match="the batched engine .* runs one-process Models"):
        generate_batch(tp, [[1, 2, 3]], 4)


def test_the_ranks_load_the_config_tp_run_checked():
    """tp_run checks --config with ModelConfig.load (a name or a path) but the ranks opened
    data/configs/<config>.json: a path passed the check and failed on every rank (tiny-b.json.json)."""
    from kdlib.tp import workers

    path = str(DATA / "configs" / "tiny-b.json")
    model, _, prompt = workers._models(check_spec(config=path, prompt_len=4), torch.device("cpu"))
    assert model.cfg == ModelConfig.load("tiny-b") and len(prompt) == 4


def test_bench_path_on_gloo_counts_two_allreduces_per_layer():
    """The benchmark worker (what the GPU run executes) on a tiny config over gloo: rows for 1 and 2
    ranks, tokens equal to the single-process engine, two all-reduces per layer per step."""
    spec = bench_spec(config="tiny-a", dtype="float32", context=16, max_new=8, budget=6, block=5, iters=3,
                      allreduce_rows=(1, 16), allreduce_hidden=32)
    p = bench([1, 2], spec, backend="gloo", timeout_s=SPAWN_TIMEOUT_S)
    layers = _cfg("tiny-a").num_hidden_layers
    runs = {(r["world"], r["engine"], r["method"]): r for r in p["runs"]}
    assert set(runs) == {(1, "tp", "ar"), (1, "single", "ar"), (1, "tp", "ddtree"), (1, "single", "ddtree"),
                         (2, "tp", "ar"), (2, "tp", "ddtree")}
    assert all(r["matches_single_ar"] for r in p["runs"])
    for method in ("ar", "ddtree"):
        assert runs[(2, "tp", method)]["allreduce_calls_per_step"] == 2 * layers
        assert runs[(1, "tp", method)]["allreduce_calls_per_step"] == 0
        assert 0 < runs[(2, "tp", method)]["allreduce_share"] < 1
    assert {r["rows"] for r in p["allreduce"]} == {1, 16} and set(p["allreduce_fit"]) == {"2"}
    assert p["allreduce_graph"] == [] and p["allreduce_graph_fit"] == {}  # CUDA graphs: NCCL only


def test_perf_suite_refuses_without_two_gpus():
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("this host has several GPUs: the suite would run")
    with pytest.raises(SystemExit, match="at least 2 GPUs"):
        suite.run(quick=True)
    assert suite.world_sizes(8) == [1, 2, 4, 8] and suite.world_sizes(3) == [1, 2]


@pytest.mark.gpu
@pytest.mark.parametrize("moe_mode", ["ep", "tp"])
def test_tp_nccl_equals_single_gpu(moe_mode):
    """On a host with several GPUs: NCCL ranks (2, and 4 when present) vs one GPU, fp32."""
    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip(f"needs at least 2 GPUs, {n} visible")
    for world in [w for w in (2, 4) if w <= n]:
        lines = run_check(world, check_spec(moe_mode=moe_mode, device="cuda"), backend="nccl")
        assert not [x for x in lines if x.startswith("FAIL")], "\n".join(lines)


@pytest.mark.parametrize("argv, message", [
    (["--world-size", "0"], "--world-size must be >= 1"),
    (["--world-size", "5"], "cannot be split over 5 ranks"),
    (["--config", "nope"], "no config 'nope'"),
    (["--quick"], "apply to --bench only"),
    (["--budget", "300"], "--budget 300 exceeds the tree kernels' limit 256"),
    (["--block", "20", "--budget", "20"], "min(--block - 1, --budget) = 19 exceeds the tree kernels'"),
    (["--max-new", "100000"], "the check's prompt (12) + --max-new (100000) exceeds the model's context"),
    (["--max-new", "1"], "--max-new must be >= 2"),
    (["--bench", "--moe-mode", "tp"], "--moe-mode applies to the check, not to --bench"),
    (["--bench", "--max-new", "3"], "--max-new applies to the check, not to --bench"),
    (["--timeout", "0"], "--timeout must be a positive number of seconds"),
])
def test_tp_run_refuses_bad_arguments_before_spawning(argv, message):
    """tools/tp_run.py: one line on stderr and exit 2, before any rank starts (they were tracebacks)."""
    import subprocess
    import sys

    from kdlib import ROOT

    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "tp_run.py"), *argv], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr



@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine --bench runs")
def test_tp_run_bench_without_a_gpu_is_refused_in_one_line():
    """--bench on a machine without GPUs: exit 2 as the other GPU-only tools, not 1 from inside the sweep."""
    import subprocess
    import sys

    from kdlib import ROOT

    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "tp_run.py"), "--bench", "--quick"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "torch sees no CUDA device here" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
