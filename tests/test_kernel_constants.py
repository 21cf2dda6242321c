"""Python's copies of kernel constants equal the kernels' own (`#define`, `constexpr`,
`__launch_bounds__`, template arguments and the shared-memory formulas in the .cu comments), read from
the sources by `kdlib.cuda.loader.source_constants` / `launch_bounds`; no GPU and no compiler needed.
"""

from __future__ import annotations

import json
import math
import re

import pytest

from kdlib import DATA, KERNELS
from kdlib.cuda import accept, attention, compact, loader, moe, tree
from kdlib.perf.suites.attention_bounds import cta_register_pool
from kdlib.ref import accept as ref_accept

# the source's name of a version's LAUNCHES smem where it is not v9's (9, 10) or SMEM_BYTES (5-8)
_SMEM_NAME = {11: "V11_SMEM", 12: "V12_SMEM"}


def consts(stem: str) -> dict[str, int]:
    return loader.source_constants(stem)


def kernel_body(stem: str, kernel: str) -> str:
    """The text of `kernel`'s body in kernels/<stem>.cu (from its name to the matching brace)."""
    text = loader.expanded_source(stem)
    start = text.index("{", re.search(rf"\b{kernel}\s*\(", text).end())
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start : i + 1]
    raise AssertionError(f"unbalanced braces in {kernel}")


# ----------------------------------------------------------------------------- the parser itself
def test_int_expression_reads_c_constant_expressions():
    names = {"A": 3, "B": 8}
    assert loader.int_expression("(A * 32 + 1) / 2", names) == 48
    assert loader.int_expression("0xffffffffu", names) == 2**32 - 1
    assert loader.int_expression("(1u << 24)", names) == 1 << 24
    assert loader.int_expression("-0x7fffffff", names) == -(2**31 - 1)
    assert loader.int_expression("B * B", names) == 64
    for not_int in ("1.4426950408889634f", "__int_as_float(0xff800000)", "C + 1", "(int)A"):
        assert loader.int_expression(not_int, names) is None


def test_int_expression_divides_as_c_and_refuses_unsigned_wraps():
    # C truncates toward zero (Python's // and % floor)
    for expr, c in (("-7 / 2", -3), ("7 / -2", -3), ("-7 % 3", -1), ("7 % -3", 1), ("-A / 2", -1),
                    ("(0 - 8) / 3 * 3 + (0 - 8) % 3", -8)):
        assert loader.int_expression(expr, {"A": 3}) == c, expr
    assert loader.int_expression("0xffffffff - 1", {}) == 2**32 - 2  # a hex past int's range is unsigned
    # values C wraps modulo 2**32 (or an unsigned 64-bit), shifts of or by negatives: not exact, so None
    for wraps in ("5u - 6u", "5 - 6u", "-1u", "0xffffffffu + 1", "0x80000000 - 0x80000001", "-7 / 2u",
                  "1ul << 40", "-1 << 2", "1 << -1"):
        assert loader.int_expression(wraps, {}) is None, wraps


def test_source_constants_of_a_file(tmp_path, monkeypatch):
    fam = tmp_path / "fam"
    fam.mkdir()
    (fam / "v1.cu").write_text(
        "#define N 4  // four\n#define BYTES (N * 16)\n#define SCALE 0.5f\n#define MAC(x) (x)\n"
        "constexpr int kA = 2, kB = kA * N;\n"
        "template <> struct U<float> { static constexpr int value = 8; };\n"
        "#define TWICE 1\n#undef TWICE\n#define TWICE 2\n"
        'extern "C" __global__ void __launch_bounds__(BYTES, kA) k_v1(int n) {}\n'
    )
    monkeypatch.setattr(loader, "KERNELS", tmp_path)
    monkeypatch.setattr(loader, "_SOURCES", {})
    assert loader.source_constants("fam/v1") == {"N": 4, "BYTES": 64, "kA": 2, "kB": 8}
    assert loader.launch_bounds("fam/v1") == {"k_v1": (64, 2)}


# ----------------------------------------------------------------------------- tree build
def _smem_formula(stem: str) -> str:
    """The dynamic shared-memory formula the .cu header states (S = budget + 1, W = ceil(S / 32))."""
    text = (KERNELS / f"{stem}.cu").read_text()
    m = re.search(
        r"Dynamic shared memory \(bytes\), S = budget \+ 1, W = ceil\(S / 32\):\n//\s+([^(\n]+)", text
    )
    assert m, f"{stem}.cu states no shared-memory formula"
    return m.group(1).strip()


@pytest.mark.parametrize("version", tree.VERSIONS)
def test_tree_shared_bytes_is_the_formula_of_the_kernel_source(version):
    stem = f"tree_build/v{version}"
    formula, names = _smem_formula(stem), consts(stem)
    for budget in (0, 1, 31, 32, 63, 64, 95, 127, 128, 200, 256):
        for l_eff, k in ((1, 1), (min(budget, 16) or 1, min(budget, 256) or 1), (7, 33)):
            s = budget + 1
            env = {**names, "S": s, "W": -(-s // 32), "L_eff": l_eff, "K": k}
            assert tree.shared_bytes(budget, l_eff, k, version) == loader.int_expression(formula, env), (
                version,
                budget,
                l_eff,
                k,
            )


def test_tree_threads_tables_and_rows_match_the_sources():
    assert tree.THREADS == consts("tree_build/v1")["TB_THREADS"] == consts("tree_build/v2")["TB2_THREADS"]
    assert tree.THREADS == consts("tree_build/v3")["TB3_THREADS"]
    assert tree.V4_THREADS == consts("tree_build/v4")["TB4_THREADS"]
    v4 = consts("tree_build/v4")
    assert tree.V4_TABLE_CELLS == v4["LPS_ROWS"] * v4["LPS_STRIDE"]
    assert consts("tree_build/v1")["TB_MAX_ROWS"] == math.ceil((tree.MAX_BUDGET + 1) / 32)
    for version in tree.VERSIONS:
        bounds = loader.launch_bounds(f"tree_build/v{version}")
        rows = sorted(int(m.group(1)) for name in bounds if (m := re.search(r"_r(\d+)$", name)))
        assert tuple(rows) == {1: (), 2: tree.V2_ROWS, 3: tree.V2_ROWS, 4: tree.V4_ROWS}[version]
        threads = tree.launch(64, version).threads
        assert {t for t, _ in bounds.values()} == {threads}
        for budget in (0, 31, 32, 64, 95, 96, 128, 129, 255, 256):
            stem, name = tree.kernel_name(budget, version)
            assert stem == f"tree_build/v{version}" and name in bounds


# ----------------------------------------------------------------------------- acceptance, compaction
def test_accept_thread_counts_match_the_sources():
    assert accept.GREEDY_THREADS == consts("tree_accept/greedy_v1")["TA_THREADS"]
    assert set(loader.launch_bounds("tree_accept/greedy_v1").values()) == {(accept.GREEDY_THREADS, 0)}
    for version in (1, 2):
        assert set(loader.launch_bounds(f"tree_accept/sample_v{version}").values()) == {
            (accept.ROW_THREADS, 0)
        }
    v3 = consts("tree_accept/sample_v3")
    # the offline default of the -D options equals what the wrapper passes (kdlib.ref.accept)
    assert (v3["TA3_THREADS"], v3["TA3_PIECE"]) == (ref_accept.SAMPLE_THREADS, ref_accept.SAMPLE_PIECE)
    assert accept.sample_options(3) == (
        f"-DTA3_THREADS={v3['TA3_THREADS']}",
        f"-DTA3_PIECE={v3['TA3_PIECE']}",
    )


def test_compact_threads_match_the_source():
    assert compact.THREADS == consts("kv_compact/v1")["KC_THREADS"]
    assert set(loader.launch_bounds("kv_compact/v1").values()) == {(compact.THREADS, 0)}


# ----------------------------------------------------------------------------- MoE W4A16
def test_moe_v1_launch_constants_match_the_source():
    c = consts("moe_w4a16/v1")
    assert moe._V1_THREADS == c["kThreads"]
    assert moe._V1_DOWN_TILES_PER_BLOCK == c["kWarps"] * c["kDownTilesPerWarp"]
    bounds = loader.launch_bounds("moe_w4a16/v1")
    assert bounds["moe_w4a16_v1_gate_up_n8"][0] == 32 * 16 == c["kThreadsN8"]  # gate_up_warps 16
    assert bounds["moe_w4a16_v1_gate_up_n8w8"][0] == 32 * 8  # gate_up_warps 8
    assert {t for name, (t, _) in bounds.items() if name != "moe_w4a16_v1_gate_up_n8"} == {moe._V1_THREADS}


def test_moe_v2_blocks_match_the_source():
    c = consts("moe_w4a16/v2")
    bounds = loader.launch_bounds("moe_w4a16/v2")
    roomy = {"sms": 1, "smem_block": 1 << 30, "smem_sm": 1 << 30, "smem_reserved": 0}
    for warps, (threads, stages, min_blocks) in moe._V2_GATE_UP.items():
        for name in (f"moe_w4a16_v2_gate_up_w{warps}", f"moe_w4a16_v2_gate_up_w{warps}i"):
            if name not in bounds:
                continue
            assert bounds[name] == (threads, min_blocks) and threads == 32 * warps
            body = kernel_body("moe_w4a16/v2", name)
            args = re.search(r"gate_up_body<(\d+), (\d+), (?:true|false)>", body).groups()
            assert tuple(map(int, args)) == (warps, stages)
            red = tuple(
                map(
                    int, re.search(r"__shared__ float red\[(\d+)\]\[(\d+)\]\[(\d+)\]\[(\d+)\]", body).groups()
                )
            )
            assert red[1] == warps and 4 * math.prod(red) == warps * moe._V2_RED_BYTES_PER_WARP
        assert moe.v2_gate_up_shape(warps, roomy)["blocks_per_sm"] == min_blocks
    assert moe._V2_STAGE_BYTES_GATE_UP == 16 * c["kGuStageVec"] + 4 * c["kGuStageWords"]
    assert moe._V2_STAGE_BYTES_DOWN == 16 * c["kDnStageVec"] + 4 * c["kDnStageWords"]
    assert moe._V2_DOWN == (32 * c["kDownWarps"], c["kDownStages"])
    assert bounds["moe_w4a16_v2_down"] == (moe._V2_DOWN[0], 1)
    assert moe._V2_MAX_N == c["kDownMaxChunks"] * moe.CHUNK_COLS


def test_moe_v3_block_matches_the_source():
    c = consts("moe_w4a16/v3")
    assert loader.launch_bounds("moe_w4a16/v3") == {"moe_w4a16_v3": (moe._V3_THREADS, moe._V3_MIN_BLOCKS)}
    assert moe._V3_THREADS == 32 * c["kWarps"]
    stages = int(re.search(r"moe_v3_body<(\d+)>", kernel_body("moe_w4a16/v3", "moe_w4a16_v3")).group(1))
    assert (
        (moe._V3_STAGES, moe._V3_STAGE_BYTES) == (stages, 16 * c["kStageVec"]) == (stages, c["kStageBytes"])
    )
    assert moe._V3_DYN_SMEM == c["kWarps"] * stages * c["kStageBytes"]
    assert moe._V3_LINE == c["kLine"] and c["kWsReady"] == 4 * c["kLine"]  # 4 counter lines, then ready flags
    assert moe._V2_MAX_N == c["kDownMaxChunks"] * moe.CHUNK_COLS


# ----------------------------------------------------------------------------- tree-verify attention
def test_attention_v1_constants_match_the_sources():
    for stem in ("tree_verify/prefix_v1", "tree_verify/tail_v1"):
        c = consts(stem)
        assert (c["D_QK"], c["D_V"], c["ROWS"], c["KCHUNK"]) == (
            attention.D_QK,
            attention.KV_LORA_RANK,
            attention._V1_ROWS,
            attention._V1_KCHUNK,
        )
        assert set(loader.launch_bounds(stem).values()) == {(32 * attention._V1_ROWS, 0)}
    assert consts("tree_verify/combine_v1")["D_V"] == attention.KV_LORA_RANK
    assert loader.launch_bounds("tree_verify/combine_v1") == {
        "tree_verify_v1_combine": (attention._COMBINE_THREADS, 0)
    }


@pytest.mark.parametrize("name", sorted(attention.MMA_VERSIONS))
def test_attention_mma_constants_match_the_sources(name):
    stem, smem = attention.MMA_VERSIONS[name]
    c = consts(stem)
    assert (c["D_QK"], c["D_V"], c["BM"], c["BN"]) == (
        attention.D_QK,
        attention.KV_LORA_RANK,
        attention._MMA_BM,
        attention._MMA_BN,
    )
    assert (c["Q_SMEM"], c["K_SMEM"], c["X_SMEM"]) == (
        attention._MMA_Q_SMEM,
        attention._MMA_K_SMEM,
        attention._MMA_X_SMEM,
    )
    assert smem == c["SMEM_BYTES"]
    assert set(loader.launch_bounds(stem).values()) == {(attention._MMA_THREADS, 1)} and c["NTHREADS"] == 256


@pytest.mark.parametrize("version", attention.WGMMA_VERSIONS)
def test_attention_wgmma_constants_match_the_source(version):
    stem = attention.LAUNCHES[version].stem
    c = consts(stem)
    assert (c["D_QK"], c["D_V"]) == (attention.D_QK, attention.KV_LORA_RANK)
    smem = {5: attention._V5_SMEM, 6: attention._V6_SMEM, 7: attention._V7_SMEM, 8: attention._V7_SMEM,
            9: attention._V9_SMEM, 10: attention._V9_SMEM, 11: attention._V11_SMEM, 12: attention._V12_SMEM,
            13: attention._V9_SMEM}
    smem = smem[version]
    name = _SMEM_NAME.get(version, "V9_SMEM" if version >= 9 else "SMEM_BYTES")
    assert c[name] == smem <= 227 * 1024
    if version == 11:  # its one pass of a request's rows, and the setmaxnreg counts fit the register file
        assert c["V11_NR"] == attention._V11_NR and c["V11_OFF_BARS"] + c["V11_NBARS"] * 8 + 1024 == smem
        assert c["NTHREADS"] == 3 * 128
        assert 128 * (c["V11_PRODUCER_REGS"] + 2 * c["V11_CONSUMER_REGS"]) <= cta_register_pool(c["NTHREADS"])
    if version in (10, 13):  # its kernel with v7's consumers launches with v7's
        assert c["SMEM_BYTES"] == attention._V7_SMEM
    if version == 12:  # v7's layout, version 12's barriers past its own, then Q8's eight latent blocks
        assert c["V12_OFF_Q8"] == -(-(c["OFF_BARS"] + (c["NBARS"] + 3) * 8) // 1024) * 1024
        assert smem == c["V12_OFF_Q8"] + 8 * c["V12_QB"] + 1024 and c["V11_NR"] == attention._V11_NR
    assert c["PLAN_SMALL_REQS"] == attention._V5_PLAN_SMALL_REQS
    if version in (10, 13):  # the host's cut for the kernels that make their own plan
        assert c["OWN_PLAN_REQS"] == attention._V10_OWN_PLAN_REQS
    assert (c["BM"], c["BN"], c["MAX_ROUNDS"], c["JOB_OVERHEAD"], c["PLAN_STRIDE"]) == (
        attention._V5_BM,
        attention._V5_BN,
        attention._V5_ROUNDS,
        attention._V5_JOB_OVERHEAD,
        attention._V5_PLAN_STRIDE,
    )
    assert (c["COMBINE_COLS"], c["COMBINE_SLICES"]) == (
        attention._V5_COMBINE_COLS,
        attention._V5_COMBINE_SLICES,
    )
    # 4 warps, float4 lanes
    assert attention._COMBINE_THREADS == 4 * 32 and attention._V5_COMBINE_COLS == 32 * 4
    # v8 runs v7's attend kernel, with combines of its own; v9's file holds v8's kernels and its own attend;
    # v10's holds v9's, its plan and its four ordered attend kernels (two of them make their own plan); v12's
    # holds v11's; v13's holds v10's and its own attend kernel (it makes its own plan) and combine
    attends = {8: (7,), 9: (7, 9), 10: (7, 9, 10), 11: (7, 9, 11), 12: (7, 9, 11, 12), 13: (7, 9, 10)}
    attends = attends.get(version, (version,))
    attends = [f"tree_verify_v{a}_attend" for a in attends] + [
        f"tree_verify_v10_attend{k}" for k in ("_t", "_own", "_t_own")] * (version in (10, 13)) + [
        "tree_verify_v13_attend_own"] * (version == 13)
    own_combines = {f"tree_verify_v8_combine_w{w}": (32 * w, 0) for w in attention._V8_COMBINE_WARPS}
    own_combines["tree_verify_v8_combine_rows"] = (32 * attention._V8_ROWS_WARPS, 0)
    if version == 13:
        own_combines["tree_verify_v13_combine_rows"] = (32 * attention._V8_ROWS_WARPS, 0)
    assert loader.launch_bounds(stem) == {  # the shared plan and combine, the version's attend
        "tree_verify_v5_plan": (attention._V5_THREADS, 0),
        **({"tree_verify_v10_plan": (attention._V5_THREADS, 0)} if version in (10, 13) else {}),
        **{a: (attention.LAUNCHES[version].threads, 1) for a in attends},
        "tree_verify_v5_combine": (attention._COMBINE_THREADS, 0),
        **(own_combines if version >= 8 else {}),
    }
    assert (c["ORDER_CAP"], c["ORDER_GAIN"], c["ORDER_UNIT"]) == (
        attention._V10_ORDER_CAP, attention._V10_ORDER_GAIN, attention._V10_ORDER_UNIT)
    assert c["PLAN_SMEM_REQS"] == attention._V5_PLAN_SMEM_REQS


def test_attention_v8_combine_warps_and_jobs_in_flight_match_the_source():
    c = consts(attention._V8)
    assert c["V8_UNROLL"] == attention._V8_UNROLL
    assert c["ROWS_WARPS"] == attention._V8_ROWS_WARPS
    bounds = loader.launch_bounds(attention._V8)
    combines = sorted(b[0] // 32 for n, b in bounds.items() if "_v8_combine_w" in n)
    assert tuple(combines) == attention._V8_COMBINE_WARPS


def test_attention_v7_warp_roles_fit_the_register_file():
    """v7: a producer warpgroup and two MMA warpgroups (NTHREADS), whose setmaxnreg counts (multiples of 8
    in [24, 256]) fit the CTA's pool (the registers it launched with, not the SM's 65536: an .inc past it
    waits for ever), the bf16 build's, the FP8 build's, timing probe 9's and version 12's; the kernel passes
    the build's pair (PRODUCER_NREG, CONSUMER_NREG), version 12's its own (V12_*_REGS)."""
    c = consts(attention._V7)
    assert c["NTHREADS"] == attention._V7_THREADS == 3 * 128
    for producer, consumer in ((c["PRODUCER_REGS"], c["CONSUMER_REGS"]),
                               (c["FP8_PRODUCER_REGS"], c["FP8_CONSUMER_REGS"]),
                               (c["PROBE9_PRODUCER_REGS"], c["PROBE9_CONSUMER_REGS"]),
                               (c["V12_PRODUCER_REGS"], c["V12_CONSUMER_REGS"])):
        assert all(r % 8 == 0 and 24 <= r <= 256 for r in (producer, consumer))
        assert 128 * producer + 256 * consumer <= cta_register_pool(c["NTHREADS"]) == 64512
    text = loader.expanded_source(attention._V7)
    assert re.findall(r"setmaxnreg\.(dec|inc)\.sync\.aligned\.u32 %0;\\n\" ::\"n\"\((\w+)\)", text) == [
        ("dec", "PRODUCER_NREG"), ("inc", "NREG")]
    assert re.search(r"constexpr int NREG = Mix::on \? V12_CONSUMER_REGS : CONSUMER_NREG;", text)
    v12 = loader.expanded_source(attention._V12)
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32 %0;\\n\" ::\"n\"\(V12_PRODUCER_REGS\)", v12)
    for role in ("PRODUCER", "CONSUMER"):
        assert re.search(rf"#define {role}_NREG \(TV_FP8 \? FP8_{role}_REGS : PROBE9 \? PROBE9_{role}_REGS : "
                         rf"{role}_REGS\)", text)


@pytest.mark.parametrize("version", attention.VERSIONS)
def test_attention_launches_name_kernels_of_their_sources(version):
    settings = attention.LAUNCHES[version]
    c, bounds = consts(settings.stem), loader.launch_bounds(settings.stem)
    name = _SMEM_NAME.get(version, "V9_SMEM" if version >= 9 else "SMEM_BYTES")
    assert settings.smem == c.get(name, 0)
    assert (settings.rows, settings.keys) == ((c["BM"], c["BN"]) if version > 1 else (c["ROWS"], c["KCHUNK"]))
    if version < 5:
        for kind in settings.dtypes:  # the name _launch_prefix composes
            assert bounds[f"tree_verify_v{version}_prefix_{kind}"][0] == settings.threads
        assert not [n for n in bounds if n.endswith("_f32")] or "f32" in settings.dtypes
    else:
        attend = {8: "tree_verify_v7_attend", 13: "tree_verify_v13_attend_own"}.get(version,
                                                                                  f"tree_verify_v{version}_attend")
        assert bounds[attend][0] == settings.threads
    assert attention.IMPLS[settings.impl] == version


# ----------------------------------------------------------------------------- defaults against the records
def _record(name: str) -> dict:
    return json.loads((DATA / "results" / f"{name}.h200.json").read_text())


def test_tree_default_is_the_recorded_headline():
    """DEFAULT_VERSION is kernels.h200.json's headline: bit-exact, and the fastest version at its batch."""
    rec = _record("kernels")
    head = rec["headline"]
    assert head["version"] == tree.DEFAULT_VERSION and head["bit_exact"]
    assert head["kernel"] == tree.kernel_name(rec["parameters"]["budget"])[1]
    at_batch = [r for r in rec["tree_build"] if r["batch"] == head["batch"]]
    assert {r["version"] for r in at_batch} == set(rec["parameters"]["tree_versions"])
    fastest = min(at_batch, key=lambda r: r["kernel_us"])
    assert fastest["version"] == tree.DEFAULT_VERSION and fastest["kernel_us"] == head["kernel_us"]


def test_attention_bf16_default_is_the_fastest_recorded_arm():
    """BF16_DEFAULT against every other arm of attention.h200.json: the fastest at most points (its median
    at or under the fastest arm's p90: arms that run the same kernels at a point, as v9 runs v8's where
    Q*H > 16, tie there and their medians order at random), and at every point no other arm faster beyond
    that arm's own replay spread (its p90) but at exactly the points BF16_DEFAULT_TRADES declares (a trade
    the record must still show, each with its reason)."""
    rec = _record("attention")
    assert attention.LAUNCHES[attention.DEFAULT_VERSION].impl == attention.BF16_DEFAULT
    assert {attention.BF16_DEFAULT, attention.MMA_DEFAULT} <= set(rec["parameters"]["impls"])
    assert rec["points"]
    fastest, beaten = 0, set()
    for p in rec["points"]:
        ms = {impl: v["kernel"]["median_ms"] for impl, v in p["variants"].items()}
        best = p["variants"][min(ms, key=ms.get)]["kernel"]
        fastest += ms[attention.BF16_DEFAULT] <= best["p90_ms"]
        if any(ms[attention.BF16_DEFAULT] > v["kernel"]["p90_ms"] for v in p["variants"].values()):
            beaten.add((p["heads"], p["queries"], p["prefix"], p["batch"]))
    assert fastest > len(rec["points"]) / 2
    assert beaten == set(attention.BF16_DEFAULT_TRADES)
    assert all(why.strip() for why in attention.BF16_DEFAULT_TRADES.values())


def test_attention_fp8_gather_and_path_rule_match_the_source_and_the_record():
    """The gather's launch constants are its source's; the FP8 layout's offsets are kdlib.ref.fp8's; and
    fp8_path=None (FP8_DEQUANT_FIRST_ROWS) takes, at every point of attention_fp8.h200.json, the path faster
    there, as recorded with the rule the code has; and so at the rows between its points
    (history/attention_fp8.path_cut.5ec8398: 104 rows fused, 136 and up dequant first)."""
    c = consts(attention._FP8_GATHER)
    assert c["FG_KEYS"] == attention._FP8_GATHER_KEYS and c["FG_OUT_U4"] * 8 == attention.D_QK
    assert loader.launch_bounds(attention._FP8_GATHER) == {
        "tree_verify_fp8_gather_v1": (32 * attention._FP8_GATHER_KEYS, 0)}
    assert (c["FP8_ROW"], c["FP8_SCALES"], c["FP8_ROPE"]) == (
        attention.FP8_ROW_BYTES, attention.KV_LORA_RANK, attention.KV_LORA_RANK + 16)
    rec = _record("attention_fp8")
    assert rec["parameters"]["fp8_dequant_first_rows"] == attention.FP8_DEQUANT_FIRST_ROWS
    for p in rec["points"]:
        arms = p["arms"]
        faster = "dequant_first" if arms["fp8_dequant_first"]["ms"] < arms["fp8"]["ms"] else "fused"
        assert attention.fp8_path_for(p["heads"] * p["queries"]) == p["fp8_path_default"] == faster, p
    cut = json.loads((DATA / "results" / "history" / "attention_fp8.path_cut.5ec8398.h200.json").read_text())
    assert cut["parameters"]["fp8_dequant_first_rows"] == attention.FP8_DEQUANT_FIRST_ROWS
    assert {r["rows"] for r in cut["rows"]} >= {104, 136}  # the two sides of the cut at 128
    for r in cut["rows"]:
        faster = "dequant_first" if r["ms"]["dequant_first"] < r["ms"]["fused"] else "fused"
        assert attention.fp8_path_for(r["rows"]) == r["rule"] == faster, r


def test_attention_mma_default_is_the_faster_mma_in_the_recorded_sweep():
    """MMA_DEFAULT (v3) against v4 in verify_attention_dev.h200.json: faster at the median point ratio."""
    rec, mma = _record("verify_attention_dev"), attention.MMA_DEFAULT
    ratios = [
        p["variants"]["mma_v4"]["kernel"]["median_ms"] / p["variants"][mma]["kernel"]["median_ms"]
        for p in rec["points"]
        if {"mma_v4", mma} <= set(p["variants"])
    ]
    assert ratios and sorted(ratios)[len(ratios) // 2] >= 1.0


def test_moe_default_pick_is_the_faster_recorded_version():
    """default_version's rule (pick_version on the H200's v3 grid) reproduces the version moe.h200.json
    recorded for every decode-regime row, and that version was the faster of v2 and v3 there."""
    rec = _record("moe")
    inter = rec["params"]["expert_inter_tp8"]
    _, min_blocks = loader.launch_bounds("moe_w4a16/v3")["moe_w4a16_v3"]
    warps = rec["provenance"]["sm_count"] * min_blocks * moe._V3_THREADS // 32  # the grid on the H200
    decode = [r for r in rec["rows"] if r["max_tokens_per_expert"] <= moe._V2_MAX_SLOTS]
    assert decode
    for r in decode:
        (picked,) = r["kernel_default_version"]
        assert picked == moe.pick_version(round(r["touched_experts"] * inter / moe.TILE_ROWS), warps), r["m"]
        graph = {v: r[f"kernel_v{v}_graph"]["median_ms"] for v in (2, 3)}
        assert min(graph, key=graph.get) == picked, (r["m"], graph)
    assert all(r["kernel_default_version"] == [1] for r in rec["rows"] if r["max_tokens_per_expert"] > 16)
