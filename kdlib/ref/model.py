"""Float64 numpy golden forward of the DeepSeek-V3 / Kimi-K2 MLA + MoE model.

    logits = forward(cfg, weights, token_ids)      # [T, V] float64; weights: HF name -> numpy array

Written from the architecture, apart from the PyTorch model in `kdlib.engine.model`, so that the two
check each other: MLA is computed here in its absorbed form (every head scores against the latent
rows [c_kv | k_rope]; `kv_b_proj` folded into the query and the output), while the torch `logits`
path expands K and V (the plain form). Everything runs in float64.

Per layer l (x: the residual stream, [T, H]):
  a      = rmsnorm(x) ; q = a Wq (or rmsnorm(a Wqa) Wqb) viewed [T, nh, nope + rope]
  c, kr  = split(a Wkva) ; c = rmsnorm(c) ; kr, q_rope rotated by RoPE at positions 0..T-1
  score  = ((q_nope Wuk_h) . c_j + q_rope_h . kr_j) * softmax_scale, causal (j <= i)
  attn   = softmax(score) ; o_h = (attn . c) Wuv_h^T ; x += concat_h(o_h) Wo
  x     += dense SwiGLU (l < first_k_dense_replace) or routed experts + shared experts
logits = rmsnorm(x) W_lm^T.

RoPE: pairs (2i, 2i+1) when `rope_interleave` (output written de-interleaved, as transformers does;
the dot product is the same either way), else halves (i, i + rope/2). The frequencies, the cos/sin
magnitude and the softmax scale are kdlib.config's one YaRN (`rope_inv_freq`,
`ModelConfig.rope_attention_factor`, `ModelConfig.softmax_scale`; transformers
`_compute_yarn_parameters`), which `test_engine_model` checks against transformers itself.

Router (DeepSeek-V3 noaux_tc): s = sigmoid(x Wg^T); choice = s + bias; with n_group > 1 a group's
score is the sum of its two largest choice values and only the topk_group best groups stay
eligible; the top num_experts_per_tok eligible experts by choice are used with weights s
(unbiased), divided by their sum (+1e-20) when norm_topk_prob, times routed_scaling_factor.
"""

from __future__ import annotations

import numpy as np

from kdlib.config import ModelConfig, rope_inv_freq


def _rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _swiglu(x, w, prefix):
    return (_silu(x @ w[prefix + "gate_proj.weight"].T) * (x @ w[prefix + "up_proj.weight"].T)) @ w[
        prefix + "down_proj.weight"
    ].T


def rope_tables(cfg: ModelConfig, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """cos, sin [T, rope/2] float64 and the softmax scale, from the config's RoPE / YaRN fields."""
    ang = positions.astype(np.float64)[:, None] * rope_inv_freq(cfg)[None, :]  # [T, rope/2]
    mag = cfg.rope_attention_factor
    return np.cos(ang) * mag, np.sin(ang) * mag, cfg.softmax_scale


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleave: bool) -> np.ndarray:
    """x [T, ..., d] -> rotated, written as [first-of-pair | second-of-pair]."""
    h = x.shape[-1] // 2
    a, b = (x[..., 0::2], x[..., 1::2]) if interleave else (x[..., :h], x[..., h:])
    c = cos.reshape(cos.shape[0], *([1] * (x.ndim - 2)), h)
    s = sin.reshape(c.shape)
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def _route(cfg, x, w, prefix):
    """x [T, H] -> (expert ids [T, k], weights [T, k])."""
    s = 1.0 / (1.0 + np.exp(-(x @ w[prefix + "gate.weight"].T)))  # [T, E]
    choice = s + w[prefix + "gate.e_score_correction_bias"][None, :]
    T, E = s.shape
    eligible = np.ones((T, E), dtype=bool)
    if cfg.n_group > 1:
        per = E // cfg.n_group
        g = np.sort(choice.reshape(T, cfg.n_group, per), axis=-1)[:, :, -2:].sum(-1)  # [T, G]
        best = np.argsort(-g, axis=-1, kind="stable")[:, : cfg.topk_group]
        gmask = np.zeros((T, cfg.n_group), dtype=bool)
        np.put_along_axis(gmask, best, True, axis=-1)
        eligible = np.repeat(gmask, per, axis=-1)
    masked = np.where(eligible, choice, -np.inf)
    ids = np.argsort(-masked, axis=-1, kind="stable")[:, : cfg.num_experts_per_tok]
    wts = np.take_along_axis(s, ids, axis=-1)
    if cfg.norm_topk_prob:
        wts = wts / (wts.sum(-1, keepdims=True) + 1e-20)
    return ids, wts * cfg.routed_scaling_factor


def forward(cfg, weights: dict, token_ids) -> np.ndarray:
    """Logits [T, V] float64 of a causal forward from position 0. `weights`: HF names -> arrays."""
    w = {k: np.asarray(v, dtype=np.float64) for k, v in weights.items()}
    ids = np.asarray(token_ids)
    # the int64 cast would run 1.7 as 1 and True as 1; an empty list (float64) gets the message below
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"token_ids must be integer token ids, got dtype {ids.dtype}")
    ids = ids.astype(np.int64)
    if ids.ndim != 1 or ids.size == 0 or ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ValueError(f"token_ids must be a non-empty 1-D array of ids in [0, {cfg.vocab_size})")
    T, nh = ids.size, cfg.num_attention_heads
    nope, rd, vd, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    cos, sin, scale = rope_tables(cfg, np.arange(T))
    causal = np.tril(np.ones((T, T), dtype=bool))
    x = w["model.embed_tokens.weight"][ids]  # [T, H]
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        a = _rmsnorm(x, w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        if cfg.q_lora_rank is None:
            q = a @ w[p + "self_attn.q_proj.weight"].T
        else:
            qa = _rmsnorm(
                a @ w[p + "self_attn.q_a_proj.weight"].T, w[p + "self_attn.q_a_layernorm.weight"], 1e-6
            )
            q = qa @ w[p + "self_attn.q_b_proj.weight"].T
        q = q.reshape(T, nh, nope + rd)
        kva = a @ w[p + "self_attn.kv_a_proj_with_mqa.weight"].T  # [T, r + rd]
        c = _rmsnorm(kva[:, :r], w[p + "self_attn.kv_a_layernorm.weight"], 1e-6)  # [T, r]
        kr = _rotate(kva[:, r:], cos, sin, cfg.rope_interleave)  # [T, rd]
        qr = _rotate(q[:, :, nope:], cos, sin, cfg.rope_interleave)  # [T, nh, rd]
        wkv = w[p + "self_attn.kv_b_proj.weight"].reshape(nh, nope + vd, r)
        q_lat = np.einsum("thn,hnr->thr", q[:, :, :nope], wkv[:, :nope])  # [T, nh, r]
        score = (np.einsum("thr,jr->htj", q_lat, c) + np.einsum("thd,jd->htj", qr, kr)) * scale  # [nh, T, T]
        score = np.where(causal[None], score, -np.inf)
        prob = np.exp(score - score.max(-1, keepdims=True))
        prob /= prob.sum(-1, keepdims=True)
        o_lat = np.einsum("htj,jr->thr", prob, c)  # [T, nh, r]
        o = np.einsum("thr,hvr->thv", o_lat, wkv[:, nope:]).reshape(T, nh * vd)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        a = _rmsnorm(x, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        if layer < cfg.first_k_dense_replace:
            x = x + _swiglu(a, w, p + "mlp.")
            continue
        ids_e, wts = _route(cfg, a, w, p + "mlp.")
        y = np.zeros_like(a)
        for t in range(T):
            for e, g in zip(ids_e[t], wts[t], strict=True):
                y[t] += g * _swiglu(a[t : t + 1], w, f"{p}mlp.experts.{e}.")[0]
        if cfg.n_shared_experts:
            y += _swiglu(a, w, p + "mlp.shared_experts.")
        x = x + y
    x = _rmsnorm(x, w["model.norm.weight"], cfg.rms_norm_eps)
    head = w["model.embed_tokens.weight"] if cfg.tie_word_embeddings else w["lm_head.weight"]
    return x @ head.T
