"""The benchmark model of the engine, engine_batch and tp suites (and the estimator's check of them):
one place, so that `kdlib.tp.workers` and the suites share it without importing each other."""

# A "tiny but not trivial" target: the MLA shapes of DeepSeek-V3 / Kimi-K2 (models-hardware.md §1)
# at 1/7 of the width and 8 layers; 32 routed experts top-4 + 1 shared. About 0.5 B parameters.
BENCH_CONFIG = {
    "model_type": "deepseek_v3",
    "vocab_size": 32768,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "moe_intermediate_size": 512,
    "num_hidden_layers": 8,
    "first_k_dense_replace": 1,
    "num_attention_heads": 16,
    "q_lora_rank": 512,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 32,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 8192,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
}
BLOCK = 16  # the DFlash b16 checkpoints' block size (survey §6): horizon L = 15
