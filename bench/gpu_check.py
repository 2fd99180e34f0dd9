"""The GPU issue's one device check: the engine's correctness and speed on CUDA, in one script.

    python bench/gpu_check.py --device cuda [--budget-s 480] [--out bench/results/gpu_check_<gpu>.json]
    python bench/gpu_check.py --device cpu --quick --simulate-gpu-box     # the dry run, here

It prints one JSON object and writes it (after every section, so a run cut short still leaves what it
measured). Sections, each timed, each failing on its own (an error is recorded, the next one runs),
skipped once the time budget is spent:
- ``env``: torch, CUDA, triton, transformers versions, the device;
- ``kernel_tests``: the ``gpu``-marked kernel tests, compiled (TRITON_INTERPRET=0), in a subprocess;
- ``correctness``: tiny-random, tiny-hybrid and a transformers-made NemotronH equal transformers'
  greedy (repeated full forwards, fp32, on the same device): alone, batched, with n-gram and MTP
  speculation, async scheduling, chunked prefill and preemption;
- ``deterministic``: deterministic mode (issue 24: the batch-invariant Triton matmul and fixed-tile
  attention on CUDA) against the fast mode on a 4-layer model of that Llama's width, bf16: decode step
  time at batch 1 and 32, and a request's greedy tokens and logprobs alone == among 15 others, bitwise;
- ``speed``: a random-weight 1.1B Llama (TinyLlama's shape, bf16): copy bandwidth and the HBM floor,
  decode step time at batch 1, 32 and 128 (steps back to back, the steady state; ``step_ms_synced``:
  each step alone after a device sync, which under async scheduling launches the next step and returns the
  finished one: the host's time a step, the floor of the steady state; ``cuda_graphs+cublas``: every matmul on cuBLAS, against the few-row
  Triton matmuls chosen per shape, whose measurements are ``skinny_choices``; ``cuda_graphs-pdl``: plain launches,
  against programmatic dependent launch; ``cuda_graphs-epilogues``: the rotary and norms after those matmuls as
  kernels of their own, against kernels/triton_skinny_epilogues.py; ``cuda_graphs+fp8_kv``: an fp8 KV cache, its
  floor counting the KV at one byte an element), prefill tok/s at 16 x 2,048 and its MFU,
  transformers' ``generate`` on the same GPU.

The GPU machine has torch, triton, transformers, safetensors, tokenizers, msgpack and numpy but no
Ray, pyzmq, FastAPI, gguf or xgrammar, and nothing downloads there: the engine runs without them
(``--simulate-gpu-box`` refuses those imports here, to prove it), the source is imported through a
namespace folder of links when pdcluster is not installed, and the tiny models are built there from
the project's seeded code with the tokenizer files this script copies into bench/gpu_assets/ first
(``--prepare-assets``; that folder is ignored by git: carry it to the device machine).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The carried tokenizer files (PDCLUSTER_GPU_ASSETS: elsewhere, as the dry-run test keeps them out of the checkout)
ASSETS = Path(os.environ.get("PDCLUSTER_GPU_ASSETS", ROOT / "bench" / "gpu_assets"))
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
GPU_BOX_MISSING = ("ray", "zmq", "fastapi", "uvicorn", "pydantic", "gguf", "xgrammar", "openai", "ucxx", "starlette")
PACKAGES = tuple(sorted(d.name for d in ROOT.iterdir() if (d / "__init__.py").is_file()))  # pdcluster.<name>
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}  # dense, SXM


# ------------------------------------------------------------------------------------------ setup


def block_modules(names: tuple[str, ...]) -> None:
    """Make ``names`` unimportable, as on the GPU machine (a dry run here proves the engine needs none)."""

    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in names:
                raise ModuleNotFoundError(f"No module named {name!r} (--simulate-gpu-box)", name=name)
            return None

    sys.meta_path.insert(0, Blocker())


def import_pdcluster() -> None:
    """``import pdcluster`` from this checkout, installed or not (a namespace folder of links)."""
    try:
        import pdcluster.engine  # noqa: F401
        return
    except ModuleNotFoundError:
        pass
    ns = Path(tempfile.mkdtemp(prefix="pdcluster-ns-")) / "pdcluster"
    ns.mkdir()
    for pkg in PACKAGES:
        (ns / pkg).symlink_to(ROOT / pkg, target_is_directory=True)
    sys.path.insert(0, str(ns.parent))
    import pdcluster.engine  # noqa: F401


def prepare_assets() -> None:
    """Copy SmolLM2's tokenizer files (from the built tiny-random model) into bench/gpu_assets/."""
    from pdcluster.engine.models.registry import resolve_model

    src = resolve_model("tiny-random", progress=False)
    ASSETS.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(src / name, ASSETS / name)
    print(f"wrote {', '.join(TOKENIZER_FILES)} to {ASSETS}", file=sys.stderr)


def build_tiny(name: str, out: Path) -> Path:
    """Build the built-in ``name`` (tiny-random / tiny-hybrid) from its seeded code, with the carried
    tokenizer files instead of the GGUF conversion (gguf is not on the GPU machine)."""
    from safetensors.torch import save_file

    if name == "tiny-random":
        from pdcluster.engine.models.tiny_random import TINY_RANDOM_CONFIG as base, tiny_random_state_dict as weights
    else:
        from pdcluster.engine.models.tiny_hybrid import TINY_HYBRID_CONFIG as base, tiny_hybrid_state_dict as weights
    out.mkdir(parents=True, exist_ok=True)
    for f in TOKENIZER_FILES:
        shutil.copy(ASSETS / f, out / f)
    generation = json.loads((out / "generation_config.json").read_text())
    config = dict(base, bos_token_id=generation["bos_token_id"], eos_token_id=generation["eos_token_id"][0],
                  pad_token_id=generation["pad_token_id"])
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(weights(config), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def build_random_nemotron_h(out: Path) -> Path:
    """A NemotronH directory made by transformers (tests/test_hybrid_model.py's shape: attention first,
    n_groups 1, conv kernel 3 without bias, state 12, scan chunk 8, untied head), random weights at a
    scale where the blocks matter; A_log and dt_bias keep transformers' init."""
    import torch
    import transformers

    from pdcluster.engine.models.random_weights import redraw_nemotron_h

    torch.manual_seed(0)
    common = dict(vocab_size=512, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=24,
                  intermediate_size=96, mamba_num_heads=6, mamba_head_dim=8, ssm_state_size=12, n_groups=1,
                  conv_kernel=3, chunk_size=8, use_conv_bias=False, tie_word_embeddings=False,
                  layer_norm_epsilon=1e-6, bos_token_id=1, eos_token_id=2)
    blocks = ["full_attention", "linear_attention", "mlp", "linear_attention", "full_attention", "linear_attention"]
    config = transformers.NemotronHConfig(layers_block_type=blocks, **common)
    if getattr(config, "num_hidden_layers", len(blocks)) != len(blocks):  # older transformers: the pattern string
        config = transformers.NemotronHConfig(hybrid_override_pattern="*M-M*M", num_hidden_layers=6, **common)
    model = transformers.NemotronHForCausalLM(config)
    redraw_nemotron_h(model)
    model.save_pretrained(str(out))
    shutil.copy(ASSETS / "tokenizer.json", out / "tokenizer.json")
    return out


# Model families made by transformers with random weights (tests/test_model_families.py's shapes): what their
# kernels do on CUDA (sliding windows and soft-capped scores in the Triton attention, two RoPE tables, Gemma's norms,
# Mixtral's MoE, Qwen2-MoE's shared expert, Phi-4-mini's partial rotary and longrope, Granite's multipliers, OLMo 3's
# post-norms, GLM-4's interleaved partial rotary, GLM-4.5's MoE, Cohere2's parallel LayerNorm blocks, SmolLM3's NoPE
# layers, Ministral 3's query scale, the Granite 4.0-H hybrid, gpt-oss's attention sinks, Llama 4's chunked attention,
# DeepSeek's latent attention).
_FAMILY_COMMON = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=96, num_hidden_layers=3, rms_norm_eps=1e-6, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=2)
FAMILIES = {
    "qwen2-yarn-swa": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        _FAMILY_COMMON, use_sliding_window=True, sliding_window=20, max_window_layers=1,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32})),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        _FAMILY_COMMON, head_dim=32, pad_token_id=0, sliding_window=20, query_pre_attn_scalar=24,
        tie_word_embeddings=False, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        _FAMILY_COMMON, head_dim=32, pad_token_id=0, sliding_window=20, query_pre_attn_scalar=24,
        tie_word_embeddings=False, attn_logit_softcapping=2.0, final_logit_softcapping=30.0)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(_FAMILY_COMMON, num_local_experts=4,
                                                            num_experts_per_tok=2, sliding_window=40)),
    "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        _FAMILY_COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
        shared_expert_intermediate_size=80, mlp_only_layers=[1], use_sliding_window=True, sliding_window=20,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"])),
    # Phi-4-mini's shape: partial rotary (q/k head dimensions permuted at load) and longrope. Its original context
    # of 4 tokens is shorter than every prompt, so transformers and the engine (max_model_len 256) both take the
    # long table.
    "phi4-mini": ("Phi3Config", "Phi3ForCausalLM", dict(
        _FAMILY_COMMON, pad_token_id=0, tie_word_embeddings=True, partial_rotary_factor=0.75,
        original_max_position_embeddings=4,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                         "original_max_position_embeddings": 4, "short_factor": [1.0, 1.01, 1.02, 1.03, 1.04, 1.05],
                         "long_factor": [1.5, 2.5, 4.0, 6.0, 8.0, 9.0]})),
    # GraniteMoe: Granite's multipliers around a sparse MoE whose router softmaxes the top-k logits.
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(
        _FAMILY_COMMON, num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=12.0,
        attention_multiplier=0.0625, residual_multiplier=0.22, logits_scaling=16.0)),
    # GLM-4: sandwich norms, interleaved partial rotary (permuted q/k dimensions), q/k/v biases.
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(_FAMILY_COMMON, pad_token_id=0, head_dim=32)),
    # GLM-4.5: DeepSeek-V3-routed MoE (group-limited, scaled) with a shared expert, after one dense layer.
    "glm4-moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        _FAMILY_COMMON, pad_token_id=0, head_dim=32, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
        topk_group=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
        routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True)),
    # Cohere2: LayerNorm, parallel blocks, interleaved RoPE on the sliding layers, NoPE full layers, scaled logits.
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", dict(_FAMILY_COMMON, pad_token_id=0, num_hidden_layers=4,
                                                            sliding_window=20, logit_scale=0.5)),
    # Ministral 3: YaRN and the position-dependent query scale past a 32-token original context.
    "ministral3": ("Ministral3Config", "Ministral3ForCausalLM", dict(
        _FAMILY_COMMON, pad_token_id=0, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
            "max_position_embeddings": 256, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
            "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.5})),
    # SmolLM3: a layer without RoPE (its K and V written by the attention kernel, not the fused rotary one).
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(_FAMILY_COMMON, pad_token_id=0,
                                                            no_rope_layer_interval=2)),
    # OLMo 3: post-norms, q/k norms over all heads, three sliding layers of four with their own RoPE beside YaRN.
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", dict(
        _FAMILY_COMMON, pad_token_id=0, num_hidden_layers=4, sliding_window=20,
        rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                            "original_max_position_embeddings": 32},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # Granite 4.0-H: Mamba2 and attention layers (no positional encoding), each with Granite's MoE and shared MLP,
    # on NemotronH's blocks (engine/models/granite_hybrid.py).
    "granite-4.0-h": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        _FAMILY_COMMON, intermediate_size=48, layer_types=["mamba", "attention", "mamba"], mamba_n_heads=8,
        mamba_d_head=16, mamba_d_state=12, mamba_n_groups=2, mamba_d_conv=3, mamba_chunk_size=8, mamba_expand=2,
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=40, embedding_multiplier=12.0,
        attention_multiplier=0.0625, residual_multiplier=0.22, logits_scaling=16.0)),
    # gpt-oss: attention sinks (folded into the Triton attention's softmax states), sliding and full layers, q/k/v
    # and o biases, YaRN, a biased router and biased experts with the clamped SwiGLU (limit 1.0: the clamp bites).
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        _FAMILY_COMMON, head_dim=16, pad_token_id=0, num_local_experts=4, num_experts_per_tok=2, sliding_window=20,
        swiglu_limit=1.0, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                           "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                           "original_max_position_embeddings": 32})),
    # Llama 4: chunked attention (16 positions) with q/k L2 norms beside NoPE full layers with the query temperature,
    # MoE layers with sigmoid-scaled expert inputs and a shared expert.
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", dict(
        _FAMILY_COMMON, head_dim=16, pad_token_id=0, num_hidden_layers=4, intermediate_size=32,
        intermediate_size_mlp=96, num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
        no_rope_layer_interval=2, attention_chunk_size=16, floor_scale=8, attn_scale=0.1)),
    # DeepSeek-V3's MLA (one 40-wide latent KV head for 4 query heads, absorbed; interleaved RoPE, YaRN mscale) and
    # its sigmoid group router; DeepSeek-V2's q_proj and softmax group-limited router.
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        _FAMILY_COMMON, num_key_value_heads=4, pad_token_id=0, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32, "mscale": 0.707, "mscale_all_dim": 0.707})),
    "deepseek-v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        _FAMILY_COMMON, num_key_value_heads=4, pad_token_id=0, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=1,
        topk_method="group_limited_greedy", moe_intermediate_size=32, n_shared_experts=2, first_k_dense_replace=1,
        routed_scaling_factor=1.5, norm_topk_prob=False)),
    # The published latent width (512 + 64): on CUDA the latent-attention kernel at its real tile width.
    "deepseek-v2-wide": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        _FAMILY_COMMON, num_key_value_heads=4, pad_token_id=0, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=32,
        qk_rope_head_dim=64, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=2, first_k_dense_replace=1, norm_topk_prob=False)),
}


def family_kwargs_for_installed_transformers(name: str, kwargs: dict) -> dict:
    """``kwargs`` with a family's shape moved off what an older transformers (the GPU machine's 5.17) computes
    otherwise than the model is defined (and than our engine, vLLM and transformers 5.24 compute), so that its
    greedy stays the oracle there: 5.17's gpt-oss clamps its SwiGLU at 7.0 whatever swiglu_limit says, and its
    Granite 4.0-H normalises the gated Mamba output over all groups at once instead of each group (equal with
    one group, as the published checkpoints have)."""
    import inspect

    if name == "gpt-oss":
        from transformers.models.gpt_oss import modeling_gpt_oss

        if "config.swiglu_limit" not in inspect.getsource(modeling_gpt_oss.GptOssExperts.__init__):
            return dict(kwargs, swiglu_limit=7.0)
    if name == "granite-4.0-h":
        from transformers.models.granitemoehybrid import modeling_granitemoehybrid

        norm = modeling_granitemoehybrid.GraniteMoeHybridRMSNormGated
        if "group_size" not in inspect.signature(norm.__init__).parameters:
            return dict(kwargs, mamba_n_groups=1)
    return kwargs


def build_family(name: str, out: Path) -> Path:
    import torch
    import transformers

    from pdcluster.engine.models.random_weights import redraw_nemotron_h

    config_cls, model_cls, kwargs = FAMILIES[name]
    kwargs = family_kwargs_for_installed_transformers(name, kwargs)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs))
    if "mamba_n_heads" in kwargs:  # a hybrid: Mamba's A_log and dt_bias keep transformers' init
        redraw_nemotron_h(model)
    else:
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():  # weights at a scale where every block matters (tests/test_qwen3.py's redraw)
            for pname, p in model.named_parameters():
                if "norm" in pname:
                    p.copy_(0.8 + 0.4 * torch.rand(p.shape, generator=gen))
                elif pname.endswith(("embed_tokens.weight", ".bias")):
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
                else:
                    gain = 3.0 if pname.endswith(("o_proj.weight", "down_proj.weight")) else 1.5
                    p.copy_(torch.randn(p.shape, generator=gen) * gain / p.shape[-1] ** 0.5)
    model.save_pretrained(str(out))
    shutil.copy(ASSETS / "tokenizer.json", out / "tokenizer.json")
    return out


# ------------------------------------------------------------------------------------------ report


class Report:
    def __init__(self, out: Path, budget_s: float):
        self.out, self.budget_s, self.t0 = out, budget_s, time.monotonic()
        self.data: dict = {"sections": {}}

    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    @contextlib.contextmanager
    def section(self, name: str, min_left_s: float = 20.0):
        entry: dict = {}
        self.data["sections"][name] = entry
        if self.left_s() < min_left_s:
            entry["skipped"] = f"time budget spent ({self.left_s():.0f} s left)"
            self.write()
            yield None
            return
        t0 = time.monotonic()
        try:
            yield entry
            entry.setdefault("ok", True)
        except Exception as e:  # noqa: BLE001 - one section's failure must not stop the others
            entry["ok"] = False
            entry["error"] = f"{type(e).__name__}: {e}"
            entry["traceback"] = traceback.format_exc()[-3000:]
            print(f"[{name}] FAILED: {entry['error']}", file=sys.stderr, flush=True)
        entry["seconds"] = round(time.monotonic() - t0, 1)
        print(f"[{name}] {'ok' if entry.get('ok') else 'FAILED'} in {entry['seconds']} s", file=sys.stderr, flush=True)
        self.write()

    def write(self) -> None:
        self.data["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.data, indent=2) + "\n")


# ------------------------------------------------------------------------------------------ checks


def env_section(entry: dict, device: str) -> None:
    import torch

    entry["torch"] = torch.__version__
    entry["cuda"] = torch.version.cuda
    entry["device"] = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    for mod in ("triton", "transformers"):
        try:
            entry[mod] = __import__(mod).__version__
        except ImportError:
            entry[mod] = None


def model_cache(work: Path) -> Path:
    """A model cache holding the built-in tiny models, built here, stamped as models/registry.py stamps
    them, so the tests' fixtures (resolve_model("tiny-random")) find them and never convert a GGUF."""
    from pdcluster.engine.models.registry import STAMP_FILE, _stamp

    cache = work / "cache"
    for name in ("tiny-random", "tiny-hybrid"):
        target = cache / "models" / name
        if not (target / STAMP_FILE).is_file():
            build_tiny(name, target)
            (target / STAMP_FILE).write_text(json.dumps(_stamp(name)) + "\n")
    return cache


def gpu_test_files() -> list[str]:
    """Every test module with ``gpu``-marked tests."""
    return sorted(f"tests/{f.name}" for f in (ROOT / "tests").glob("test_*.py") if "mark.gpu" in f.read_text())


def start_kernel_tests(device: str, left_s: float, work: Path, simulate: bool) -> tuple[subprocess.Popen, float, Path]:
    """The gpu-marked tests, compiled (TRITON_INTERPRET=0), in a subprocess that runs beside the next
    sections (Triton compiles on the host's cores while the GPU runs them). Here (no CUDA) only their
    collection runs, under the GPU machine's missing modules when ``simulate``: proof they import there."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
           "PDCLUSTER_CACHE_DIR": str(model_cache(work))}
    if simulate:  # a sitecustomize that refuses what the GPU machine lacks (pyzmq travels as a wheel)
        site = work / "simulate-site"
        site.mkdir(exist_ok=True)
        missing = tuple(m for m in GPU_BOX_MISSING if m != "zmq")
        (site / "sitecustomize.py").write_text(
            "import sys\n"
            "class _Blocker:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            f"        if name.split('.')[0] in {missing!r}:\n"
            "            raise ModuleNotFoundError(f'No module named {name!r} (simulated GPU machine)', name=name)\n"
            "sys.meta_path.insert(0, _Blocker())\n")
        env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    args = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *gpu_test_files()]
    if device != "cuda":
        args.append("--collect-only")
    log_path = work / "kernel_tests.log"
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, text=True)
    return proc, time.monotonic() + max(30.0, min(300.0, left_s - 60)), log_path


def finish_kernel_tests(entry: dict, started: tuple[subprocess.Popen, float, Path], device: str) -> None:
    proc, deadline, log_path = started
    try:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        entry["timed_out"] = True
    out = log_path.read_text(errors="replace")
    entry["files"] = gpu_test_files()
    entry["collect_only"] = device != "cuda"
    entry["returncode"] = proc.returncode
    # pytest's last summary line (a CUDA IPC warning from a child process can print after it)
    lines = out.strip().splitlines()
    entry["summary"] = next((ln for ln in reversed(lines) if re.search(r"\d+ (passed|failed|error)", ln)),
                            lines[-1] if lines else "")
    entry["ok"] = proc.returncode == 0
    if proc.returncode != 0:
        entry["output_tail"] = out[-24000:]


def _prompts(vocab: int, lengths=(5, 17, 40, 70), seed: int = 1) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, min(vocab, 30000), (n,), generator=gen).tolist() for n in lengths]  # ids < vocab


def _oracle(model_dir: Path, prompts: list[list[int]], num_new: int, device: str) -> list[list[int]]:
    """transformers' greedy by repeated full forwards (no cache: its cached Mamba path skips the dt
    clamp its prefill applies), fp32 on ``device``; a NemotronH's dt clamp pinned to its config's
    time_step_limit, as ours (the GPU machine's transformers 5.17 clamps at time_step_min)."""
    import torch
    import transformers

    from pdcluster.engine.models.random_weights import pin_dt_limit

    hf = pin_dt_limit(transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="eager").to(device).eval())
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = list(p)
            for _ in range(num_new):
                ids.append(int(hf(torch.tensor([ids], device=device)).logits[0, -1].argmax()))
            out.append(ids[len(p):])
    del hf
    return out


def _ours(model_dir: Path, prompts, num_new: int, device: str, lora_names=None, **cfg) -> tuple[list[list[int]], dict]:
    """``lora_names``: per prompt, the adapter of ``cfg["lora_modules"]`` it runs with (None: the base model)."""
    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.llm_engine import LLMEngine
    from pdcluster.engine.sampling_params import SamplingParams

    base = dict(model=str(model_dir), device=device, dtype="float32", num_kv_blocks=256, max_model_len=256,
                max_num_seqs=16)
    base.update(cfg)
    engine = LLMEngine.from_config(EngineConfig(**base), progress=False)
    if base.get("mixed_cuda_graph_tokens") and device == "cpu":
        engine.runner.use_mixed_graphs(base["mixed_cuda_graph_tokens"], emulate=True)  # the dry run's pieces
    names = lora_names or [None] * len(prompts)
    outs = engine.generate(prompts, [SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True, lora_name=n)
                                     for n in names])
    stats = {"num_preemptions": engine.scheduler.num_preemptions_total,
             "num_draft_tokens": sum(o.num_draft_tokens for o in outs),
             "num_accepted_tokens": sum(o.num_accepted_tokens for o in outs),
             "blocks_leaked": engine.kv_spec.num_blocks - engine.scheduler.block_manager.num_free_blocks,
             # Decode steps replayed through CUDA graphs (hybrids too: their Mamba updates in the graph).
             "graph_replays": engine.runner.graphs.num_replays if engine.runner.graphs is not None else 0,
             # Prefill / mixed steps replayed through piecewise CUDA graphs (0 where the model is not split).
             "piecewise_replays": engine.runner.mixed_graphs.num_replays if engine.runner.mixed_graphs else 0}
    return [o.token_ids for o in outs], stats


def write_random_adapter(model_dir: Path, out: Path, rank: int = 8, seed: int = 7,
                         merged: bool = True) -> tuple[Path, Path | None]:
    """A random LoRA adapter for the Llama model in ``model_dir`` on all seven projections, in PEFT's format
    (the GPU machine has no peft), and (``merged``) the model with it merged (W + alpha / r * B @ A:
    transformers' oracle for the adapter). Returns (adapter dir, merged model dir or None)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    files = sorted(model_dir.glob("*.safetensors"))
    shapes = {}
    for f in files:
        with safe_open(str(f), "pt") as st:
            shapes.update({k: st.get_slice(k).get_shape() for k in st.keys()})
    weights = {k: v for f in files for k, v in load_file(str(f)).items()} if merged else {}
    gen = torch.Generator().manual_seed(seed)
    alpha, adapter = 2.0 * rank, {}
    for layer in range(json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]):
        for part, module in [("self_attn", m) for m in ("q_proj", "k_proj", "v_proj", "o_proj")] + \
                            [("mlp", m) for m in ("gate_proj", "up_proj", "down_proj")]:
            name = f"model.layers.{layer}.{part}.{module}"
            out_features, in_features = shapes[f"{name}.weight"]
            a = torch.randn(rank, in_features, generator=gen) / in_features ** 0.5
            b = torch.randn(out_features, rank, generator=gen) * 0.2
            adapter[f"base_model.model.{name}.lora_A.weight"], adapter[f"base_model.model.{name}.lora_B.weight"] = a, b
            if merged:
                w = weights[f"{name}.weight"]
                weights[f"{name}.weight"] = (w.float() + alpha / rank * b @ a).to(w.dtype)
    lora_dir = out / "adapter"
    lora_dir.mkdir(parents=True, exist_ok=True)
    save_file(adapter, str(lora_dir / "adapter_model.safetensors"))
    (lora_dir / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": ["q_proj", "k_proj", "v_proj",
         "o_proj", "gate_proj", "up_proj", "down_proj"], "bias": "none"}))
    if not merged:
        return lora_dir, None
    merged_dir = out / "merged"
    shutil.copytree(model_dir, merged_dir, dirs_exist_ok=True)
    for f in merged_dir.glob("*.safetensors"):
        f.unlink()
    save_file(weights, str(merged_dir / "model.safetensors"), metadata={"format": "pt"})
    return lora_dir, merged_dir


def lora_check(model_dir: Path, prompts, expected_base, num_new: int, device: str, work: Path) -> dict:
    """A batch of base and adapter requests (engine/lora/) equals transformers on the base and on the merged
    model; in fp32 on the device, with CUDA graphs (on by default: decode steps with adapter rows replay too)."""
    lora_dir, merged_dir = write_random_adapter(model_dir, work / "lora")
    expected_lora = _oracle(merged_dir, prompts, num_new, device)
    names = ["a" if i % 2 else None for i in range(len(prompts))]
    expected = [e_lora if n else e_base for n, e_base, e_lora in zip(names, expected_base, expected_lora)]
    got, stats = _ours(model_dir, prompts, num_new, device, lora_names=names, lora_modules=(f"a={lora_dir}",))
    return {"ok": got == expected and stats["blocks_leaked"] == 0 and expected_lora != expected_base,
            "adapter_changes_output": expected_lora != expected_base, **stats,
            "first_diff": next(({"prompt": i, "lora": n, "got": g, "expected": e}
                                for i, (n, g, e) in enumerate(zip(names, got, expected)) if g != e), None)}


def weight_update_check(model_dir: Path, prompts, expected, num_new: int, device: str, work: Path) -> dict:
    """An engine started on other weights (engine/models/perturbed.py), its decode steps captured and replayed
    through CUDA graphs, then updated in place to ``model_dir``'s (engine/weight_update.py): it answers as
    transformers does on ``model_dir``, the graphs replaying on the copied weights."""
    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.llm_engine import LLMEngine
    from pdcluster.engine.models.perturbed import perturb_checkpoint
    from pdcluster.engine.sampling_params import SamplingParams

    other = perturb_checkpoint(model_dir, work / "weights-other", seed=1)
    engine = LLMEngine.from_config(EngineConfig(model=str(other), device=device, dtype="float32", num_kv_blocks=256,
                                                max_model_len=256, max_num_seqs=16), progress=False)
    params = SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True)
    before = [o.token_ids for o in engine.generate(prompts, params)]
    graphs = engine.runner.graphs
    replays_before = graphs.num_replays if graphs is not None else 0
    update = engine.update_weights_from_disk(str(model_dir), "gpu-check")
    got = [o.token_ids for o in engine.generate(prompts, params)]
    replays = (graphs.num_replays if graphs is not None else 0) - replays_before
    return {"ok": got == expected and before != expected and (device != "cuda" or replays > 0),
            "other_weights_differ": before != expected, "graph_replays_after": replays,
            "update_s": round(update.seconds, 3), "num_bytes": update.num_bytes,
            "first_diff": next(({"prompt": i, "got": g, "expected": e} for i, (g, e) in enumerate(zip(got, expected))
                                if g != e), None)}


def draft_model_check(model_dir: Path, prompts, expected, num_new: int, device: str, work: Path) -> dict:
    """Draft-model speculation (engine/proposers/draft_model.py) on the device: the model as its own draft (every
    draft accepted in fp32), its first layers as the draft (engine/models/layer_skip.py) and a random draft of a
    quarter of its KV a token (packed), chunked prefill and async scheduling too; each equals transformers' greedy
    and leaks no block."""
    from pdcluster.engine.models.layer_skip import write_layer_skip_draft
    from pdcluster.engine.models.tiny_random import write_random_draft

    first = write_layer_skip_draft(model_dir, work / "draft-first-layers", 2)
    # A quarter of the target's KV a token: its 3 layers packed into one cache layer (engine/kv_cache.py), read and
    # written in place by the Triton kernels.
    narrow = write_random_draft(model_dir, work / "draft-narrow", 3, 1, 16)
    result, ok = {}, True
    for name, cfg in {"self": dict(draft_model=str(model_dir)),
                      "first_layers+chunked": dict(draft_model=str(first), prefill_chunk_size=7,
                                                   max_num_batched_tokens=32),
                      "narrow_packed+chunked": dict(draft_model=str(narrow), prefill_chunk_size=7,
                                                    max_num_batched_tokens=32),
                      "self+other_scheduling": dict(draft_model=str(model_dir), async_scheduling=device != "cuda")
                      }.items():
        got, stats = _ours(model_dir, prompts, num_new, device, spec_method="draft_model", num_spec_tokens=3, **cfg)
        case_ok = got == expected and stats["blocks_leaked"] == 0 and stats["num_draft_tokens"] > 0
        if name.startswith("self"):
            case_ok = case_ok and stats["num_accepted_tokens"] == stats["num_draft_tokens"]
        result[name] = {"ok": case_ok, **{k: stats[k] for k in ("num_draft_tokens", "num_accepted_tokens")}}
        ok = ok and case_ok
    return {"ok": ok, **result}


def prompt_embeds_check(model_dir: Path, prompts, expected, num_new: int, device: str) -> dict:
    """Prompts given as embeddings (engine/prompt_embeds.py): each prompt's table rows, whole and with its middle
    third as rows between ids (a chat's prompt_embeds part), batched and in prefill chunks of 7: transformers'
    greedy tokens of the ids; the prompt steps run eagerly, the decode steps through the graphs."""
    import dataclasses

    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.llm_engine import LLMEngine
    from pdcluster.engine.prompt_embeds import prompt_embeds_from_pieces
    from pdcluster.engine.sampling_params import SamplingParams

    result, ok = {}, True
    for name, cfg in {"batch": {}, "chunked": dict(prefill_chunk_size=7, max_num_batched_tokens=32)}.items():
        engine = LLMEngine.from_config(EngineConfig(model=str(model_dir), device=device, dtype="float32",
                                                    num_kv_blocks=256, max_model_len=256, max_num_seqs=16,
                                                    enable_prompt_embeds=True, **cfg), progress=False)
        table = engine.model.embed_tokens.float().cpu()
        params = SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True)
        whole = [o.token_ids for o in engine.generate([{"prompt_embeds": table[p]} for p in prompts], params)]
        mixed_prompts, mixed_params = [], []
        for p in prompts:
            lo, hi = len(p) // 3, max(len(p) // 3 + 1, 2 * len(p) // 3)
            rows = prompt_embeds_from_pieces([table[p[lo:hi]]], [lo], [f"prompt of {len(p)}"])
            mixed_prompts.append(p[:lo] + [0] * (hi - lo) + p[hi:])
            mixed_params.append(dataclasses.replace(params, prompt_embeds=rows))
        mixed = [o.token_ids for o in engine.generate(mixed_prompts, mixed_params)]
        replays = engine.runner.graphs.num_replays if engine.runner.graphs is not None else 0
        case_ok = whole == expected and mixed == expected and (device != "cuda" or replays > 0)
        result[name] = {"ok": case_ok, "whole_ok": whole == expected, "mixed_ok": mixed == expected,
                        "graph_replays": replays,
                        "blocks_leaked": engine.kv_spec.num_blocks - engine.scheduler.block_manager.num_free_blocks}
        ok = ok and case_ok and result[name]["blocks_leaked"] == 0
    return {"ok": ok, **result}


def shared_kv_tier_check(model_dir: Path, prompts, expected, num_new: int, device: str, work: Path) -> dict:
    """The shared KV tier (engine/kv_offload/shared_tier.py) on the device: one engine computes the prompts, writing
    each cached block through to a folder (a pinned copy queued on the compute stream, the file written by its own
    thread); a second engine on that folder, which never computed them, loads their prefixes from it onto the device
    and answers as transformers does."""
    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.llm_engine import LLMEngine
    from pdcluster.engine.sampling_params import SamplingParams

    folder = work / "kv-shared"
    shutil.rmtree(folder, ignore_errors=True)
    params = SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True)
    got, offloaded = [], []
    for _ in ("writer", "reader"):
        engine = LLMEngine.from_config(EngineConfig(model=str(model_dir), device=device, dtype="float32",
                                                    num_kv_blocks=256, max_model_len=256, max_num_seqs=16,
                                                    block_size=16, kv_offload_shared_dir=str(folder),
                                                    kv_offload_shared_gib=0.25), progress=False)
        outs = [engine.generate([p], params)[0] for p in prompts]  # one at a time: each a whole prompt's blocks
        got.append([o.token_ids for o in outs])
        offloaded.append(sum(o.num_offloaded_tokens for o in outs))
        engine.offload.tiers.shared.flush()
        engine.offload.close()
        del engine
    files = len(list(folder.glob("*/*.kvb")))
    return {"ok": got[0] == expected and got[1] == expected and offloaded[0] == 0 and offloaded[1] > 0,
            "writer_ok": got[0] == expected, "reader_ok": got[1] == expected,
            "reader_offloaded_tokens": offloaded[1], "files": files}


def encoders_check(device: str, work: Path) -> dict:
    """Encoder-only models (engine/models/bert.py, modernbert.py) made tiny by transformers: a BERT's [CLS] and mean
    embeddings of a batch of four prompt lengths, an XLM-R cross-encoder's scores, a ModernBERT's mean embeddings and
    mean-pooled cross-encoder's scores, and a BERT token classifier's logits at every token, fp32 on the device,
    against transformers' on the CPU (within 1e-4); bf16 on the device near fp32 (within 0.05 of a unit vector)."""
    import numpy as np
    import torch

    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.llm_engine import LLMEngine
    from pdcluster.engine.models.tiny_bert import build_tiny_bert, transformers_outputs

    texts = ["the quick brown fox", "paris is the capital of france . berlin is in germany , rome in italy",
             "an encoder reads every token both ways and pools them into one vector", "dog"]
    query, docs = "what is the capital of france ?", texts[:3]
    out: dict = {}
    bert = build_tiny_bert(work / "tiny-bert", "bert")
    want = transformers_outputs(bert, texts)

    def engine(path, dtype):
        return LLMEngine.from_config(EngineConfig(model=str(path), device=device, dtype=dtype, num_kv_blocks=0,
                                                  max_model_len=0), progress=False)

    fp32 = engine(bert, "float32")
    cls = fp32.embed(texts, pooling="cls", normalize=False)
    mean = fp32.embed(texts, pooling="mean", normalize=False)
    out["embed_max_abs_diff"] = max(max(float(np.abs(c - w[0].numpy()).max()), float(np.abs(m - w.mean(0).numpy()).max()))
                                    for c, m, w in zip(cls, mean, want))
    unit32 = fp32.embed(texts, pooling="cls")
    unit16 = engine(bert, "bfloat16").embed(texts, pooling="cls")
    out["bf16_max_abs_diff"] = max(float(np.abs(a - b).max()) for a, b in zip(unit32, unit16))
    cross = build_tiny_bert(work / "tiny-xlmr-cross", "xlm-roberta-cross")
    want_scores = [float(torch.sigmoid(x)[0]) for x in transformers_outputs(cross, [(query, d) for d in docs])]
    got_scores = engine(cross, "float32").score(query, docs)
    out["score_max_abs_diff"] = float(np.abs(np.array(got_scores) - np.array(want_scores)).max())
    # ModernBERT (engine/models/modernbert.py): rotary, band layers (a 53-token prompt over a +-4 band), mean-pooled
    # cross-encoder with every bias.
    modern = build_tiny_bert(work / "tiny-modernbert", "modernbert")
    long_texts = texts[:2] + [" ".join(texts[2].split() * 4)]
    want = transformers_outputs(modern, long_texts)
    got = engine(modern, "float32").embed(long_texts, pooling="mean", normalize=False)
    out["modernbert_embed_max_abs_diff"] = max(float(np.abs(g - w.mean(0).numpy()).max()) for g, w in zip(got, want))
    modern_cross = build_tiny_bert(work / "tiny-modernbert-cross", "modernbert-cross")
    want_scores = [float(torch.sigmoid(x)[0]) for x in transformers_outputs(modern_cross, [(query, d) for d in docs])]
    got_scores = engine(modern_cross, "float32").score(query, docs)
    out["modernbert_score_max_abs_diff"] = float(np.abs(np.array(got_scores) - np.array(want_scores)).max())
    # A token classifier (NER): every token's logits (the per-token pooling path, "token_classify").
    ner = build_tiny_bert(work / "tiny-bert-token", "bert-token")
    want = transformers_outputs(ner, long_texts)
    got = engine(ner, "float32").encode(long_texts, "token_classify", activation=False)
    out["token_classify_max_abs_diff"] = max(float(np.abs(g - w.numpy()).max()) for g, w in zip(got, want))
    out["ok"] = (out["embed_max_abs_diff"] < 1e-4 and out["score_max_abs_diff"] < 1e-4 and out["bf16_max_abs_diff"] < 0.05
                 and out["modernbert_embed_max_abs_diff"] < 1e-4 and out["modernbert_score_max_abs_diff"] < 1e-4
                 and out["token_classify_max_abs_diff"] < 1e-4)
    return out


def images_check(tokenizer_dir: Path, num_new: int, device: str, work: Path) -> dict:
    """Image prompts (engine/multimodal/) on a tiny LLaVA made by transformers: a batch of prompts with one image, two
    images and none, then the same chunked through the images' placeholders with preemption, equal transformers'
    greedy on the same pixels, fp32 on the device (the tower, the projector and the image rows there). Needs Pillow
    (carried as a wheel: bench/gpu_session.sh)."""
    import importlib.util

    if importlib.util.find_spec("PIL") is None:
        return {"ok": False, "error": "Pillow is not installed: carry its wheel in .whl (bench/gpu_session.sh)"}
    from pdcluster.engine.multimodal.tiny_llava import build_tiny_llava, png, transformers_greedy
    from pdcluster.engine.sampling_params import SamplingParams

    model_dir = build_tiny_llava(work / "tiny-llava", tokenizer_dir)
    images = [png(1, 40, 36), png(2, 64, 48), png(3, 33, 50)]
    one = "USER: <image>\nWhat is in this picture? ASSISTANT:"  # tests/test_multimodal.py's prompts
    cases = [(one, images[:1]), (one, images[1:2]),
             ("USER: <image>\nand <image>\nWhich one is brighter? ASSISTANT:", images[2:] + images[:1]),
             ("USER: Tell me a story about a cat. ASSISTANT:", [])]
    params = SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True)
    out = _tiny_images_check(model_dir, cases, transformers_greedy, num_new, device, params, num_kv_blocks=9)
    out["llava_next"] = _llava_next_check(tokenizer_dir, num_new, device, work, params)
    from pdcluster.engine.multimodal.tiny_qwen2_vl import VERSIONS

    for version in VERSIONS:
        out[version] = _qwen2_vl_check(tokenizer_dir, num_new, device, work, params, version)
    for name in ("mistral3", "pixtral-llava"):
        out[name] = _mistral3_check(tokenizer_dir, num_new, device, work, params, name == "pixtral-llava")
    out["gemma3"] = _gemma3_check(tokenizer_dir, num_new, device, work, params)
    out["ok"] = out["images_change_output"] and all(out[v]["ok"] for v in (
        "batch", "chunked+preemption", "llava_next", *VERSIONS, "mistral3", "pixtral-llava", "gemma3"))
    return out


def _gemma3_check(tokenizer_dir: Path, num_new: int, device: str, work: Path, params) -> dict:
    """Gemma 3 on the device (tests/test_gemma3_images.py's prompts): the framed soft tokens, prefill chunks of 18
    that end before an image instead of inside it, and the first token's top-5 logprobs of a two-image prompt equal
    transformers' with its image mask (the soft tokens' both-ways attention on the device), not without it."""
    import io

    import torch
    import transformers
    from PIL import Image

    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.llm_engine import LLMEngine
    from pdcluster.engine.multimodal.tiny_gemma3 import build_tiny_gemma3, transformers_greedy
    from pdcluster.engine.multimodal.tiny_llava import png
    from pdcluster.engine.sampling_params import SamplingParams

    model_dir = build_tiny_gemma3(work / "tiny-gemma3", tokenizer_dir)
    one = "user\n<start_of_image>What is in this picture?\nmodel\n"
    two = "user\n<start_of_image>and<start_of_image>\n\nWhich one is brighter?\nmodel\n"
    images = [png(1, 40, 36), png(2, 64, 48), png(3, 33, 50)]
    cases = [(one, images[:1]), (one, images[1:2]), (two, images[2:] + images[:1]),
             ("user\nTell me a story about a cat.\nmodel\n", [])]
    out = _tiny_images_check(model_dir, cases, transformers_greedy, num_new, device, params, num_kv_blocks=13,
                             chunk_tokens=18)
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32)
    hf = hf.to(device).eval()
    engine = LLMEngine.from_config(EngineConfig(model=str(model_dir), device=device, dtype="float32",
                                                num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=18),
                                   progress=False)
    pair = images[2:] + images[:1]
    ids, _ = engine.model.image_encoder.spec.expand(engine.tokenizer.encode(two), pair)
    processor = transformers.AutoImageProcessor.from_pretrained(str(model_dir))
    pixels = processor(images=[Image.open(io.BytesIO(b)).convert("RGB") for b in pair],
                       return_tensors="pt")["pixel_values"].to(device)
    t = torch.tensor([ids], device=device)
    with torch.inference_mode():
        both, causal = (hf(input_ids=t, pixel_values=pixels, **kw).logits[0, -1].float().log_softmax(-1).cpu()
                        for kw in ({"token_type_ids": (t == hf.config.image_token_index).long()}, {}))
    top = engine.generate([{"prompt": two, "multi_modal_data": {"image": pair}}],
                          SamplingParams(max_tokens=1, temperature=0.0, logprobs=5))[0].logprobs[0]
    got, want = torch.tensor(top.top_logprobs), both[top.top_token_ids]
    out["both_ways"] = {"ok": bool(torch.allclose(got, want, atol=1e-3)
                                   and (causal[top.top_token_ids] - want).abs().max() > 1e-3),
                        "max_abs_diff": float((got - want).abs().max()),
                        "causal_max_abs_diff": float((causal[top.top_token_ids] - want).abs().max())}
    out["ok"] = out["ok"] and out["both_ways"]["ok"]
    return out


def _qwen2_vl_check(tokenizer_dir: Path, num_new: int, device: str, work: Path, params, version: str) -> dict:
    """Qwen2-VL / Qwen2.5-VL / Qwen3-VL on the device: M-RoPE image rows (scratch rows of the rotary table), shifted
    decode positions, Qwen3-VL's deepstack rows (tests/test_qwen2_vl.py's prompts)."""
    from pdcluster.engine.multimodal.tiny_llava import png
    from pdcluster.engine.multimodal.tiny_qwen2_vl import build_tiny_qwen2_vl, transformers_greedy

    model_dir = build_tiny_qwen2_vl(work / f"tiny-{version}", tokenizer_dir, version)
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    one = f"<|im_start|>user\n{image}What is in this picture?<|im_end|>\n<|im_start|>assistant\n"
    two = f"<|im_start|>user\n{image}and{image}Which one is brighter?<|im_end|>\n<|im_start|>assistant\n"
    images = [png(1, 40, 36), png(2, 48, 30), png(3, 33, 50)]
    cases = [(one, images[:1]), (one, images[1:2]), (two, images[2:] + images[:1]),
             ("<|im_start|>user\nTell me a story about a cat.<|im_end|>\n<|im_start|>assistant\n", [])]
    return _tiny_images_check(model_dir, cases, transformers_greedy, num_new, device, params, num_kv_blocks=10)


def _mistral3_check(tokenizer_dir: Path, num_new: int, device: str, work: Path, params, llava: bool) -> dict:
    """Mistral 3 (Pixtral's tower; ``llava``: Pixtral-12B's LLaVA form) on the device: runs of [IMG] rows closed by
    break / end tokens (tests/test_mistral3_images.py's prompts)."""
    from pdcluster.engine.multimodal.tiny_llava import png
    from pdcluster.engine.multimodal.tiny_mistral3 import build_tiny_mistral3, transformers_greedy

    model_dir = build_tiny_mistral3(work / ("tiny-pixtral-llava" if llava else "tiny-mistral3"), tokenizer_dir, llava)
    one = "[INST][IMG]What is in this picture?[/INST]"
    images = [png(1, 40, 36), png(2, 64, 48), png(3, 33, 50)]
    cases = [(one, images[:1]), (one, images[1:2]), ("[INST][IMG]and[IMG]Which one is brighter?[/INST]",
                                                     images[2:] + images[:1]),
             ("[INST]Tell me a story about a cat.[/INST]", [])]
    return _tiny_images_check(model_dir, cases, transformers_greedy, num_new, device, params, num_kv_blocks=11)


def _tiny_images_check(model_dir: Path, cases, transformers_greedy, num_new: int, device: str, params,
                       num_kv_blocks: int, chunk_tokens: int = 5) -> dict:
    """A tiny image checkpoint's ``cases`` (prompt, images) batched, then in prefill chunks of ``chunk_tokens`` through
    the placeholders with a pool of ``num_kv_blocks`` blocks of 8 (preempting), equal transformers' greedy."""
    import torch
    import transformers

    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.llm_engine import LLMEngine
    from pdcluster.engine.multimodal.spec import ImageSpec
    from pdcluster.engine.tokenizer import Tokenizer

    spec, tokenizer = ImageSpec.from_dir(model_dir), Tokenizer(model_dir)
    hf = transformers.AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32)
    hf = hf.to(device).eval()
    expected = [transformers_greedy(model_dir, spec.expand(tokenizer.encode(t), i)[0], i, num_new, device, hf)
                for t, i in cases]
    del hf
    prompts = [{"prompt": t, "multi_modal_data": {"image": i}} if i else t for t, i in cases]
    out = {"images_change_output": expected[0] != expected[1]}
    for vname, cfg in (("batch", {}), ("chunked+preemption", dict(max_num_batched_tokens=chunk_tokens, block_size=8,
                                                                   num_kv_blocks=num_kv_blocks,
                                                                   enable_prefix_caching=False))):
        engine = LLMEngine.from_config(EngineConfig(**{**dict(model=str(model_dir), device=device, dtype="float32",
                                                              num_kv_blocks=64, max_model_len=256), **cfg}),
                                       progress=False)
        got = [o.token_ids for o in engine.generate(prompts, params)]
        ok = got == expected and (vname == "batch" or engine.scheduler.num_preemptions_total > 0)
        out[vname] = {"ok": ok, "num_preemptions": engine.scheduler.num_preemptions_total,
                      "images_encoded": engine.runner.image_embeds.num_encoded,
                      "first_diff": next(({"prompt": k, "got": g, "expected": e}
                                          for k, (g, e) in enumerate(zip(got, expected)) if g != e), None)}
    out["ok"] = out["images_change_output"] and out["batch"]["ok"] and out["chunked+preemption"]["ok"]
    return out


def _llava_next_check(tokenizer_dir: Path, num_new: int, device: str, work: Path, params) -> dict:
    """LLaVA-NeXT's tiles on the device: images of three sizes (three counts of placeholders), batched, equal
    transformers' LlavaNextForConditionalGeneration greedy."""
    import torch
    import transformers

    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.llm_engine import LLMEngine
    from pdcluster.engine.multimodal.spec import ImageSpec
    from pdcluster.engine.multimodal.tiny_llava import build_tiny_llava, png, transformers_greedy
    from pdcluster.engine.tokenizer import Tokenizer

    model_dir = build_tiny_llava(work / "tiny-llava-next", tokenizer_dir, next_=True)
    one = "USER: <image>\nWhat is in this picture? ASSISTANT:"
    images = [png(11, 40, 36), png(13, 33, 90), png(14, 100, 20)]
    spec, tokenizer = ImageSpec.from_dir(model_dir), Tokenizer(model_dir)
    hf = transformers.LlavaNextForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32)
    hf = hf.to(device).eval()
    expected = [transformers_greedy(model_dir, spec.expand(tokenizer.encode(one), [i])[0], [i], num_new, device, hf)
                for i in images]
    del hf
    engine = LLMEngine.from_config(EngineConfig(model=str(model_dir), device=device, dtype="float32",
                                                num_kv_blocks=128, max_model_len=512), progress=False)
    got = [o.token_ids for o in engine.generate([{"prompt": one, "multi_modal_data": {"image": i}} for i in images],
                                                params)]
    return {"ok": got == expected, "placeholders": [spec.tokens_for(i) for i in images],
            "first_diff": next(({"prompt": k, "got": g, "expected": e}
                                for k, (g, e) in enumerate(zip(got, expected)) if g != e), None)}


CORRECTNESS_MODELS = ("tiny-random", "tiny-hybrid", "nemotron-h-random", *FAMILIES)


class DeviceFault(RuntimeError):
    """A CUDA error that poisons the process's context (an illegal address): every later launch fails too."""


def _is_device_fault(e: BaseException) -> bool:
    import torch

    return isinstance(e, getattr(torch, "AcceleratorError", ())) or "CUDA error" in str(e)


def correctness_section(entry: dict, device: str, work: Path, quick: bool, only: set[str] | None = None,
                        on_progress=lambda: None) -> None:
    """``only``: the model names to check (a rerun of the ones that failed), default all. ``on_progress``:
    called as each model starts (``entry["in_progress"]`` names it) and ends, to write the report. A device
    fault ends the section after the model that met it (DeviceFault): the process's CUDA context is lost."""
    num_new = 8 if quick else 16
    wanted = lambda name: only is None or name in only  # noqa: E731
    models = {name: build_tiny(name, work / name) for name in ("tiny-random", "tiny-hybrid") if wanted(name)}
    try:
        if wanted("nemotron-h-random"):
            models["nemotron-h-random"] = build_random_nemotron_h(work / "nemotron-h-random")
    except Exception as e:  # noqa: BLE001 - transformers without NemotronH: say so, check the rest
        entry["nemotron-h-random"] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    for family in filter(wanted, FAMILIES):
        try:
            models[family] = build_family(family, work / family)
        except Exception as e:  # noqa: BLE001 - a transformers without the class: say so, check the rest
            entry[family] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    variants = {
        "alone": dict(prompts=slice(0, 1)),
        "batch": {},
        "chunked+preemption": dict(prefill_chunk_size=7, max_num_batched_tokens=32, num_kv_blocks=8),
        # Prefill and mixed steps through piecewise CUDA graphs (engine/piecewise_graphs.py; off by default).
        "chunked+piecewise": dict(prefill_chunk_size=7, max_num_batched_tokens=32, mixed_cuda_graph_tokens=32),
        "ngram": dict(spec_method="ngram", num_spec_tokens=3),
        "mtp": dict(spec_method="mtp", num_spec_tokens=2, mtp_checkpoint="random"),
        # The other scheduling than the device's default (CUDA: async, CPU: synchronous), asked for.
        "other_scheduling": dict(async_scheduling=device != "cuda"),
        "other_scheduling+mtp": dict(async_scheduling=device != "cuda", spec_method="mtp", num_spec_tokens=2,
                                     mtp_checkpoint="random"),
        # The other mode than the device's default (CUDA: fast, CPU: deterministic), asked for.
        "other_mode": dict(deterministic=device != "cuda"),
        "other_mode+chunked+mtp": dict(deterministic=device != "cuda", prefill_chunk_size=7,
                                       max_num_batched_tokens=32, spec_method="mtp", num_spec_tokens=2,
                                       mtp_checkpoint="random"),
    }
    all_ok = True
    fault = None
    for name, model_dir in models.items():
        entry["in_progress"] = name
        on_progress()
        prompts = _prompts(json.loads((model_dir / "config.json").read_text())["vocab_size"])
        expected = _oracle(model_dir, prompts, num_new, device)
        result: dict = {"not_degenerate": len({tuple(e) for e in expected}) > 1}
        for vname, cfg in variants.items():
            if quick and vname in ("other_scheduling", "other_scheduling+mtp", "ngram"):
                continue
            if name in FAMILIES and vname not in ("batch", "chunked+preemption", "chunked+piecewise", "other_mode"):
                continue  # the families check their own kernels; speculation and scheduling are the same code
            if vname == "chunked+piecewise" and name in ("tiny-hybrid", "nemotron-h-random"):
                continue  # hybrids are not split into pieces (engine/piecewise_graphs.py): the eager path again
            cfg = dict(cfg)
            sel = cfg.pop("prompts", slice(None))
            try:
                got, stats = _ours(model_dir, prompts[sel], num_new, device, **cfg)
                ok = got == expected[sel] and stats["blocks_leaked"] == 0
                if vname == "chunked+preemption":
                    ok = ok and stats["num_preemptions"] > 0
                if vname == "chunked+piecewise" and name == "tiny-random":  # the plain Llama is always split
                    ok = ok and stats["piecewise_replays"] > 0
                result[vname] = {"ok": ok, **stats}
                if not ok:
                    result[vname]["first_diff"] = next(
                        ({"prompt": i, "got": g, "expected": e} for i, (g, e) in enumerate(zip(got, expected[sel]))
                         if g != e), None)
            except Exception as e:  # noqa: BLE001
                result[vname] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                                 "traceback": traceback.format_exc()[-1500:]}
                if device == "cuda" and _is_device_fault(e):
                    fault = f"{name} {vname}: {type(e).__name__}"
                    break
            all_ok = all_ok and result[vname]["ok"]
        if name == "tiny-random" and fault is None:
            checks = {  # the tiny Llama's other paths, each on its own; a device fault ends them (the context is lost)
                "lora": lambda: lora_check(model_dir, prompts, expected, num_new, device, work),
                "weight_update": lambda: weight_update_check(model_dir, prompts, expected, num_new, device, work),
                "draft_model": lambda: draft_model_check(model_dir, prompts, expected, num_new, device, work),
                "images": lambda: images_check(model_dir, num_new, device, work),
                "prompt_embeds": lambda: prompt_embeds_check(model_dir, prompts, expected, num_new, device),
                "shared_kv_tier": lambda: shared_kv_tier_check(model_dir, prompts, expected, num_new, device, work),
                "encoders": lambda: encoders_check(device, work),
            }
            for check, run in checks.items():
                if fault is not None:
                    break
                try:
                    result[check] = run()
                except Exception as e:  # noqa: BLE001
                    result[check] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                                     "traceback": traceback.format_exc()[-1500:]}
                    if device == "cuda" and _is_device_fault(e):
                        fault = f"{name} {check}: {type(e).__name__}"
                all_ok = all_ok and result[check]["ok"]
        entry[name] = result
        del entry["in_progress"]
        on_progress()
        if fault is not None:
            raise DeviceFault(fault)
    entry["ok"] = all_ok and all(entry.get(m, {}).get("ok", True) for m in ("nemotron-h-random", *FAMILIES))


def isolated_correctness(entry: dict, args, report: "Report", work: Path) -> None:
    """The correctness section in child processes: a device fault (an illegal address poisons a CUDA context)
    costs the model that met it, not the models after it or the speed section, which run in fresh processes.
    A child that dies or faults mid-model leaves that model marked failed; the next child takes the rest."""
    wanted = [n for n in CORRECTNESS_MODELS if not args.models or n in args.models.split(",")]
    names = list(wanted)  # those still to check
    # Under this process's work folder, which it removes: a child that aborts cannot leave its models behind.
    child_out = work / "child-correctness.json"
    entry["processes"] = 0
    while names and entry["processes"] < len(CORRECTNESS_MODELS):
        if entry["processes"] and report.left_s() < 30:
            entry["not_run"] = names  # the budget went on the earlier processes
            break
        # The child's own budget is unbounded: it checks every model it is given (this process's budget decides
        # whether another child starts).
        cmd = [sys.executable, __file__, "--device", args.device, "--sections", "correctness", "--in-process",
               "--models", ",".join(names), "--out", str(child_out), "--budget-s", "1e9",
               "--work-dir", str(work / f"child{entry['processes']}")]
        cmd += ["--quick"] * args.quick + ["--simulate-gpu-box"] * args.simulate_gpu_box
        if args.crash_in and entry["processes"] == 0:
            cmd += ["--crash-in", args.crash_in]
        child_out.unlink(missing_ok=True)
        proc = subprocess.run(cmd, cwd=ROOT, stdout=sys.stderr, stderr=subprocess.STDOUT,
                              timeout=max(60.0, report.left_s() + 120))
        entry["processes"] += 1
        got = json.loads(child_out.read_text())["sections"].get("correctness", {}) if child_out.exists() else {}
        for name in names:
            if name in got:
                entry[name] = got[name]
        crashed = got.get("in_progress")
        if crashed is not None:  # the child died inside it
            entry[crashed] = {"ok": False, "error": f"the check's process ended with status {proc.returncode} "
                                                    "inside this model"}
        if "error" in got:
            entry.setdefault("device_faults", []).append(got["error"])
        done = [n for n in names if n in entry]
        if not done and crashed is None:  # it died before any model (an import, a build): no progress to make
            entry["error"] = f"the correctness process ended with status {proc.returncode} before any model"
            break
        names = [n for n in names if n not in entry]
        report.write()
    entry["ok"] = "error" not in entry and all(_model_ok(entry.get(n, {"ok": False})) for n in wanted)


def _model_ok(result: dict) -> bool:
    """A model's correctness: its own ok (a build or a process that failed), else every variant's."""
    return result.get("ok", all(v.get("ok", False) for v in result.values() if isinstance(v, dict)))


def _copy_bandwidth_gbps(device: str) -> float:
    import torch

    n = (1 << 30) // 2 if device == "cuda" else (1 << 26)
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * src.element_size() / best / 1e9  # read + write


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


LLAMA_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                num_key_value_heads=4, vocab_size=49152, max_position_embeddings=4096, rope_theta=10000.0,
                rms_norm_eps=1e-5, tie_word_embeddings=False)
LLAMA_QUICK = dict(LLAMA_1B, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2)


def random_llama(shape: dict, device: str, out: Path):
    """A seeded random-weight Llama of ``shape`` in bf16 on ``device``, saved to ``out`` with the carried
    tokenizer files: (the transformers model, ``out``)."""
    import torch
    import transformers

    torch.manual_seed(0)
    with torch.device(device):
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).to(torch.bfloat16).eval()
    hf.save_pretrained(str(out))
    for f in TOKENIZER_FILES:
        shutil.copy(ASSETS / f, out / f)
    return hf, out


def _profile_steps(engine, device: str, num_steps: int = 3) -> dict:
    """Where a decode step's time goes: the host's wall time against the GPU's busy time, and the
    kernels that took the most GPU time (torch.profiler over ``num_steps`` steps)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    _sync(device)
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(num_steps):
            engine.step()
        _sync(device)
    wall_ms = (time.perf_counter() - t0) * 1e3 / num_steps
    events = prof.key_averages()
    attr = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    kernels = sorted(((e.key, getattr(e, attr, 0.0), e.count) for e in events), key=lambda x: -x[1])
    gpu_ms = sum(getattr(e, attr, 0.0) for e in events) / 1e3 / num_steps if device == "cuda" else None
    out = {"wall_ms_per_step": round(wall_ms, 3), "gpu_busy_ms_per_step": round(gpu_ms, 3) if gpu_ms else None,
           "top": [{"name": k[:90], "ms_per_step": round(t / 1e3 / num_steps, 4), "calls_per_step": c / num_steps}
                   for k, t, c in kernels[:14]]}
    if device == "cuda":
        try:
            out["gpu_timeline"] = _gpu_idle(prof, num_steps)
        except Exception as e:  # noqa: BLE001 - a diagnostic
            out["gpu_timeline"] = {"error": f"{type(e).__name__}: {e}"}
    # The host's side: Python functions by their own time over 10 steps (cProfile's overhead inflates
    # them alike; what matters is the order).
    import cProfile
    import pstats

    prof_py = cProfile.Profile()
    prof_py.enable()
    for _ in range(10):
        engine.step()
    _sync(device)
    prof_py.disable()
    stats = pstats.Stats(prof_py)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:18]  # (file, line, fn) -> (cc, nc, tt, ct, callers)
    out["host_top"] = [{"fn": f"{Path(k[0]).name}:{k[1]}:{k[2]}"[:90], "own_ms_per_step": round(v[2] * 100, 4),
                        "calls_per_step": v[1] / 10} for k, v in rows]
    return out


def _gpu_idle(prof, num_steps: int, device_type=None) -> dict:
    """The device's timeline in the profile: from its first kernel to its last, how long no kernel or copy
    ran, and the longest such gaps with the kernels either side (where the GPU waited on the host)."""
    from torch.autograd import DeviceType

    device_type = DeviceType.CUDA if device_type is None else device_type
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == device_type and e.time_range.end > e.time_range.start)
    if not spans:
        return {"kernels": 0}
    gaps, busy_end, prev = [], spans[0][1], spans[0][2]
    for start, end, name in spans[1:]:
        if start > busy_end:
            gaps.append((start - busy_end, prev, name))
        if end > busy_end:
            busy_end, prev = end, name
    idle_us = sum(g[0] for g in gaps)
    return {"kernels_per_step": len(spans) / num_steps,
            "span_ms_per_step": round((busy_end - spans[0][0]) / 1e3 / num_steps, 3),
            "idle_ms_per_step": round(idle_us / 1e3 / num_steps, 3),
            "gaps_over_20us_per_step": round(sum(1 for g in gaps if g[0] > 20) / num_steps, 1),
            "longest_gaps": [{"us": round(g, 1), "after": a[:60], "before": b[:60]}
                             for g, a, b in sorted(gaps, reverse=True)[:8]]}


def _decode_step_ms(engine, batch: int, prompt_len: int, num_steps: int, device: str,
                    profile_into: dict | None = None, synced_into: dict | None = None,
                    lora_name: str | None = None, phases_into: dict | None = None) -> float:
    """Decode step time at ``batch`` in the steady state: ``num_steps`` steps back to back, the device
    synchronised only before the first and after the last (with async scheduling a step is launched
    while the one before it runs; a sync before each step would drain that pipeline and time every step
    as if alone). ``synced_into[str(batch)]``, if given, gets the median of steps timed one at a time
    after a sync (the figure this check reported until launch-ahead). ``lora_name``: every request runs with
    that adapter (engine/lora/). ``phases_into[str(batch)]``, if given, gets those synced steps' host time phase by
    phase and the torch calls of a step (bench/host_phases.py: host_overhead's breakdown, on this device)."""
    from pdcluster.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=4 * num_steps + 24, temperature=0.0, ignore_eos=True, lora_name=lora_name)
    for i in range(batch):
        engine.add_request([5 + (i * 7 + j) % 20000 for j in range(prompt_len)], params)
    started = set()
    for _ in range(10_000):  # until every request has its first token (prefill done)
        for out in engine.step():
            if out.num_output_tokens:
                started.add(out.request_id)
        if len(started) == batch:
            break
    engine.step()  # one more: with async scheduling the next decode step is in flight from here on
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(num_steps):
        engine.step()
    _sync(device)
    step_ms = (time.perf_counter() - t0) / num_steps * 1e3
    if synced_into is not None:
        times = []
        for _ in range(num_steps):
            _sync(device)
            t1 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t1)
        synced_into[str(batch)] = round(statistics.median(times) * 1e3, 3)
    if phases_into is not None:
        try:
            from host_phases import host_phases, torch_calls_per_step

            phases = host_phases(engine, num_steps, lambda: _sync(device))
            phases["torch_calls"] = torch_calls_per_step(engine, 3)
            phases_into[str(batch)] = phases
        except Exception as e:  # noqa: BLE001 - a diagnostic: never fail the timing for it
            phases_into[str(batch)] = {"error": f"{type(e).__name__}: {e}"}
    if profile_into is not None:
        try:
            profile_into[str(batch)] = _profile_steps(engine, device)
        except Exception as e:  # noqa: BLE001 - a diagnostic: never fail the timing for it
            profile_into[str(batch)] = {"error": f"{type(e).__name__}: {e}"}
    for rid in list(started):
        engine.abort_request(rid)
    while engine.has_unfinished():
        engine.step()
    return step_ms


def _mixed_step_ms(engine, num_decoding: int, prompt_len: int, repeats: int, device: str) -> float:
    """Median time of a mixed step: ``num_decoding`` requests decoding and a new prompt of ``prompt_len`` tokens
    prefilled in the same step (it finishes there: max_tokens 1), timed one step at a time after a sync (the
    engine schedules synchronously here, so a step is one forward)."""
    from pdcluster.engine.batch_classifier import BatchKind
    from pdcluster.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=4 * repeats + 64, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request([5 + (i * 7 + j) % 20000 for j in range(64)], params) for i in range(num_decoding)]
    for _ in range(10_000):
        engine.step()
        if all(r.output_token_ids for r in engine.scheduler.running) and len(engine.scheduler.running) == num_decoding:
            break
    times = []
    for r in range(repeats + 1):  # the first: the bucket's warm-up and capture
        engine.add_request([7 + (r * 11 + j) % 20000 for j in range(prompt_len)], SamplingParams(max_tokens=1))
        _sync(device)
        t0 = time.perf_counter()
        engine.step()
        _sync(device)
        if engine.runner.last_batch_kind != BatchKind.PREFILL_OR_MIXED:
            raise RuntimeError("the timed step was not a mixed one")
        times.append(time.perf_counter() - t0)
    for rid in rids:
        engine.abort_request(rid)
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times[1:]) * 1e3


def mixed_steps(model_dir: Path, device: str, quick: bool) -> dict:
    """Prefill/mixed steps eager against piecewise CUDA graphs (engine/piecewise_graphs.py): decode rows beside a
    new prompt's tokens, the step's tokens a bucket's size."""
    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.llm_engine import LLMEngine

    cases = ((1, 63), (32, 224)) if not quick else ((1, 15), (4, 28))
    repeats = 3 if quick else 12
    out: dict = {}
    for mode, tokens in (("eager", 0), ("piecewise", 512)):
        engine = LLMEngine.from_config(EngineConfig(
            model=str(model_dir), device=device, dtype="bfloat16", max_model_len=4096, max_num_seqs=64,
            max_num_batched_tokens=2048, kv_cache_memory_gib=0.25 if quick else 4.0, enable_prefix_caching=False,
            async_scheduling=False, mixed_cuda_graph_tokens=tokens), progress=False)
        if tokens and device == "cpu":
            engine.runner.use_mixed_graphs(tokens, emulate=True)  # the dry run: the same path, nothing captured
        pieces = engine.runner.mixed_graphs
        out[mode] = {"used": pieces is not None}
        for num_decoding, prompt_len in cases:
            ms = _mixed_step_ms(engine, num_decoding, prompt_len, repeats, device)
            out[mode][f"{num_decoding}+{prompt_len}"] = {"step_ms": round(ms, 3), "num_tokens": num_decoding + prompt_len}
        if pieces is not None:
            out[mode]["num_replays"], out[mode]["num_captures"] = pieces.num_replays, pieces.num_captures
        del engine
    for case in out["eager"]:
        if case != "used" and case in out["piecewise"]:
            out["piecewise"][case]["speedup"] = round(out["eager"][case]["step_ms"] / out["piecewise"][case]["step_ms"], 2)
    return out


PROFILED_MODES = ("cuda_graphs", "cuda_graphs+fp8_kv", "cuda_graphs+sync", "deterministic+cuda_graphs")


def speed_section(entry: dict, device: str, work: Path, quick: bool, report: Report) -> None:
    import torch
    import transformers

    from pdcluster.engine import skinny_linear
    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.gc_heap import frozen
    from pdcluster.engine.llm_engine import LLMEngine

    shape = LLAMA_QUICK if quick else LLAMA_1B
    bw = _copy_bandwidth_gbps(device)
    entry["copy_bandwidth_gbps"] = round(bw, 1)
    hf, model_dir = random_llama(shape, device, work / "llama-1b")
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    entry["weight_bytes"] = weight_bytes
    entry["hbm_floor_ms"] = round(weight_bytes / (bw * 1e9) * 1e3, 3)
    report.write()

    prompt_len, num_steps = (64, 4) if quick else (512, 24)
    batches = (1, 4) if quick else (1, 32, 128)
    decode: dict = {}
    profiles: dict = {}
    host_phases_ms: dict = {}  # "cuda_graphs": where a step's host time goes (bench/host_phases.py)
    # The fast mode (CUDA's default: cuBLAS, the fast attention tiles) and deterministic mode (the
    # batch-invariant Triton matmul and fixed attention tiles); async scheduling (CUDA's default) but in
    # "cuda_graphs+sync".
    # "lora": every request with one rank-16 adapter on all seven projections (engine/lora/: the stacked updates
    # inside the CUDA graphs; on the H200 of s51, before they were, such steps ran eagerly at 17-21 ms).
    adapter_dir, _ = write_random_adapter(model_dir, work / "llama-1b-lora", rank=16, merged=False)
    # "cuda_graphs+cublas": as "cuda_graphs" with every matmul on cuBLAS (--no-skinny-gemm), the A/B of the
    # few-row Triton matmul (engine/skinny_linear.py), whose per-shape choices land in ``skinny_choices``.
    # "cuda_graphs-pdl": as "cuda_graphs" with plain launches (--no-pdl), the A/B of programmatic dependent launch
    # (kernels/launch_pdl.py). With PDL a kernel's profiled time includes its wait for the one before it.
    # "cuda_graphs-epilogues": as "cuda_graphs" with the rotary + KV write and the norms after the skinny matmuls as
    # kernels of their own (--no-skinny-epilogues), the A/B of kernels/triton_skinny_epilogues.py.
    # "cuda_graphs+fp8_kv": as "cuda_graphs" over an fp8 (e4m3) KV cache (--kv-cache-dtype fp8): half the KV bytes a
    # step reads, so its floor counts them at one byte an element.
    modes = (("cuda_graphs", True, None, False), ("cuda_graphs+fp8_kv", True, None, False),
             ("cuda_graphs+cublas", True, None, False),
             ("cuda_graphs-pdl", True, None, False), ("cuda_graphs-epilogues", True, None, False),
             ("cuda_graphs+sync", True, False, False), ("deterministic+cuda_graphs", True, None, True),
             ("eager", False, None, False), ("lora", True, None, False))
    for mode, graphs, async_sched, det in modes:
        kv_elem_bytes = 1 if mode == "cuda_graphs+fp8_kv" else 2
        lora = dict(lora_modules=(f"a={adapter_dir}",), max_lora_rank=16) if mode == "lora" else {}
        # Every bucket captured at start-up (the default) in the first mode only, timed: the others capture at first
        # use, as before, which keeps the section's time (the step times do not depend on when a bucket was captured).
        capture_at_start = mode == "cuda_graphs"
        t_start = time.perf_counter()
        engine = LLMEngine.from_config(EngineConfig(model=str(model_dir), device=device, dtype="bfloat16", max_model_len=4096,
                                        max_num_seqs=max(batches), max_num_batched_tokens=8192,
                                        prefill_chunk_size=2048, kv_cache_memory_gib=0.25 if quick else 8.0,
                                        enable_prefix_caching=False, cuda_graphs=graphs,
                                        async_scheduling=async_sched, deterministic=det,
                                        skinny_gemm=mode != "cuda_graphs+cublas", pdl=mode != "cuda_graphs-pdl",
                                        skinny_epilogues=mode != "cuda_graphs-epilogues",
                                        cuda_graph_capture_at_start=capture_at_start,
                                        kv_cache_dtype="fp8" if kv_elem_bytes == 1 else "auto", **lora),
                                       progress=False)
        if graphs and device == "cpu":
            engine.runner.use_decode_graphs(emulate=True)  # the dry run: the same path, nothing captured
            if capture_at_start:
                engine.runner.graphs.capture_all()
        decode[mode] = {"used": engine.runner.graphs is not None, "deterministic": engine.deterministic}
        if capture_at_start and engine.runner.graphs is not None:
            decode[mode]["engine_start_s"] = round(time.perf_counter() - t_start, 2)  # load, warm-up, every capture
            decode[mode]["buckets_captured_at_start"] = engine.runner.graphs.num_captures
        # Timed as a worker process runs its engine: the start-up objects frozen (engine/gc_heap.py).
        with frozen():
            for b in batches:
                synced: dict = {}
                ms = _decode_step_ms(engine, b, prompt_len, num_steps, device,
                                     profile_into=profiles.setdefault(mode, {}) if mode in PROFILED_MODES else None,
                                     synced_into=synced, lora_name="a" if mode == "lora" else None,
                                     phases_into=host_phases_ms if mode == "cuda_graphs" else None)
                kv_bytes = b * (prompt_len + num_steps // 2) * shape["num_hidden_layers"] * 2 \
                    * shape["num_key_value_heads"] * (shape["hidden_size"] // shape["num_attention_heads"]) \
                    * kv_elem_bytes
                floor = (weight_bytes + kv_bytes) / (bw * 1e9) * 1e3
                decode[mode][str(b)] = {"step_ms": round(ms, 3), "floor_ms": round(floor, 3),
                                        "x_floor": round(ms / floor, 2), "tokens_per_s": round(b / ms * 1e3, 1),
                                        "step_ms_synced": synced[str(b)]}
                report.write()
        if graphs and engine.runner.graphs is not None:
            decode[mode]["num_replays"] = engine.runner.graphs.num_replays
        if engine._stepper is not None:  # async scheduling: steps launched before the previous one finished
            decode[mode]["steps_launched_ahead"] = engine.num_steps_launched_ahead
        del engine
    entry["decode"] = {"context_tokens": prompt_len, "gc_frozen": True, **decode}
    entry["decode_profiles"] = profiles
    entry["decode_host_phases"] = host_phases_ms
    entry["skinny_choices"] = skinny_linear.choices()
    try:
        entry["mixed_steps"] = mixed_steps(model_dir, device, quick)
    except Exception as e:  # noqa: BLE001 - a new measurement: never lose the section for it
        entry["mixed_steps"] = {"error": f"{type(e).__name__}: {e}"}
    report.write()

    # Prefill: 16 x 2,048 (quick: 4 x 256) in one step, the fast mode (CUDA's default) and deterministic mode.
    from pdcluster.engine.sampling_params import SamplingParams

    n_seq, seq_len = (4, 256) if quick else (16, 2048)
    # Matmul FLOPs: the decoder layers' weights (the embedding is a lookup; the LM head runs on one row a
    # sequence), plus causal attention (QK and PV over half the square).
    layer_params = sum(p.numel() for n, p in hf.named_parameters() if ".layers." in n)
    h, layers = shape["hidden_size"], shape["num_hidden_layers"]
    flops = 2 * layer_params * n_seq * seq_len + 2 * layers * n_seq * seq_len * seq_len * h
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in entry.get("device", "")), None)
    entry["prefill"] = {"num_seqs": n_seq, "seq_len": seq_len, "flops": flops}
    # "fast_unequal": prompts of four lengths (2,048 down to 1,904), as a served batch has: on CUDA the
    # cuDNN path then runs one padded call a request (kernels/flash_prefill.py), not one batched call.
    equal = [seq_len] * n_seq
    unequal = [seq_len - 48 * (i % 4) for i in range(n_seq)]
    for mode, det, lens in (("fast", False, equal), ("deterministic", True, equal), ("fast_unequal", False, unequal)):
        mode_flops = 2 * layer_params * sum(lens) + 2 * layers * h * sum(n * n for n in lens)
        engine = LLMEngine.from_config(EngineConfig(
            model=str(model_dir), device=device, dtype="bfloat16", max_model_len=4096, max_num_seqs=n_seq,
            max_num_batched_tokens=n_seq * seq_len, prefill_chunk_size=seq_len,
            kv_cache_memory_gib=0.5 if quick else 12.0, enable_prefix_caching=False, deterministic=det), progress=False)

        def one_prefill(profiled: bool = False) -> float:
            for i, length in enumerate(lens):
                engine.add_request([5 + (i * 13 + j) % 20000 for j in range(length)], SamplingParams(max_tokens=1))
            if profiled:
                result = _profile_steps(engine, device, num_steps=1)
            else:
                _sync(device)
                t0 = time.perf_counter()
                engine.step()
                _sync(device)
                result = time.perf_counter() - t0
            while engine.has_unfinished():
                engine.step()
            return result

        one_prefill()  # warm-up (allocator, kernels)
        dt = min(one_prefill() for _ in range(2))
        entry["prefill"][mode] = {
            "deterministic": engine.deterministic, "seconds": round(dt, 4), "prompt_lens": sorted(set(lens)),
            "tokens_per_s": round(sum(lens) / dt, 1), "tflops": round(mode_flops / dt / 1e12, 1),
            "mfu": round(mode_flops / dt / 1e12 / peak, 3) if peak else None}
        if not det:  # prompts without context go to FlashAttention in the fast mode (kernels/flash_prefill.py)
            from pdcluster.kernels import flash_prefill

            # (counts since the process started: the unequal mode's include the equal one's)
            entry["prefill"][mode]["flash_attention"] = {"layer_calls": flash_prefill.num_calls,
                                                         "refused": flash_prefill.disabled_reason(),
                                                         "cudnn_layer_calls": flash_prefill.num_cudnn_calls,
                                                         "cudnn_refused": flash_prefill.cudnn_disabled_reason()}
        try:
            entry["prefill"][mode]["profile"] = one_prefill(profiled=True)
        except Exception as e:  # noqa: BLE001 - a diagnostic
            entry["prefill"][mode]["profile"] = {"error": f"{type(e).__name__}: {e}"}
        del engine
        report.write()

    # transformers generate on the same GPU (eager, dynamic cache): per decode step.
    hf_steps = {}
    for b in batches[:2]:
        ids = torch.randint(5, 20000, (b, prompt_len), device=device)
        with torch.inference_mode():
            def gen(n: int) -> float:
                _sync(device)
                t0 = time.perf_counter()
                hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
                _sync(device)
                return time.perf_counter() - t0
            gen(2)
            short = min(gen(2) for _ in range(2))
            long = min(gen(2 + num_steps) for _ in range(2))
        hf_steps[str(b)] = round((long - short) / num_steps * 1e3, 3)
    entry["transformers_generate_step_ms"] = hf_steps


def deterministic_section(entry: dict, device: str, work: Path, quick: bool) -> None:
    """Deterministic vs fast mode on one model (module doc). ``ok``: the engine kept deterministic mode and
    the request alone equals the request in a batch; the fast mode's answer to that is recorded only."""
    import torch
    import transformers

    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.llm_engine import LLMEngine
    from pdcluster.engine.sampling_params import SamplingParams

    shape = LLAMA_QUICK if quick else dict(LLAMA_1B, num_hidden_layers=4)
    model_dir = work / "llama-deterministic"
    torch.manual_seed(0)
    with torch.device(device):
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).to(torch.bfloat16).save_pretrained(
            str(model_dir))
    for f in TOKENIZER_FILES:
        shutil.copy(ASSETS / f, model_dir / f)
    prompt_len, num_steps, batches = (64, 4, (1, 4)) if quick else (512, 16, (1, 32))
    params = SamplingParams(max_tokens=8 if quick else 24, temperature=0.0, ignore_eos=True, logprobs=2)
    target = [5 + (j * 31) % 20000 for j in range(37)]
    others = [[5 + (i * 7 + j * 13) % 20000 for j in range(10 + 9 * i)] for i in range(15)]
    for mode, deterministic in (("fast", False), ("deterministic", True)):
        engine = LLMEngine.from_config(EngineConfig(
            model=str(model_dir), device=device, dtype="bfloat16", max_model_len=2048, max_num_seqs=32,
            max_num_batched_tokens=4096, prefill_chunk_size=2048, kv_cache_memory_gib=0.25 if quick else 4.0,
            enable_prefix_caching=False, deterministic=deterministic), progress=False)
        result: dict = {"engine_deterministic": engine.deterministic, "decode_step_ms": {}}
        for b in batches:
            result["decode_step_ms"][str(b)] = round(_decode_step_ms(engine, b, prompt_len, num_steps, device), 3)
        alone = engine.generate([target], params)[0]
        mixed = engine.generate(others[:5] + [target] + others[5:], [params] * 16)[5]
        result["alone_equals_batch"] = alone.token_ids == mixed.token_ids and alone.logprobs == mixed.logprobs
        entry[mode] = result
        del engine
    fast, det = entry["fast"]["decode_step_ms"], entry["deterministic"]["decode_step_ms"]
    entry["decode_cost"] = {b: round(det[b] / fast[b], 3) for b in fast}  # deterministic / fast step time
    entry["ok"] = entry["deterministic"]["engine_deterministic"] and entry["deterministic"]["alone_equals_batch"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--budget-s", type=float, default=480.0, help="stop starting sections past this")
    p.add_argument("--out", default=None, help="default bench/results/gpu_check_<gpu>.json")
    p.add_argument("--quick", action="store_true", help="small shapes (the dry run on a CPU)")
    p.add_argument("--simulate-gpu-box", action="store_true", help="refuse the modules the GPU machine lacks")
    p.add_argument("--prepare-assets", action="store_true", help="copy the tokenizer files and exit")
    p.add_argument("--sections", default="env,kernel_tests,correctness,deterministic,speed")
    p.add_argument("--in-process", action="store_true",
                   help="correctness in this process (a child of the isolated run) instead of child processes")
    p.add_argument("--crash-in", default=None, metavar="MODEL",
                   help="the dry run of the isolation: the first correctness process dies as MODEL starts")
    p.add_argument("--work-dir", default=None, help=argparse.SUPPRESS)  # a child's, under its parent's
    p.add_argument("--models", default=None,
                   help="correctness: these models only (comma list: tiny-random, tiny-hybrid, nemotron-h-random "
                        "or a family), default all")
    args = p.parse_args()
    if args.simulate_gpu_box:
        block_modules(GPU_BOX_MISSING)
    import_pdcluster()
    if args.prepare_assets:
        prepare_assets()
        return 0
    if not all((ASSETS / f).is_file() for f in TOKENIZER_FILES):
        print(f"{ASSETS}: tokenizer files missing: run `python bench/gpu_check.py --prepare-assets` where pdcluster "
              "is installed, then carry bench/gpu_assets", file=sys.stderr)
        return 2
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch sees no CUDA device", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name().split()[-1] if args.device == "cuda" else "cpu"
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"gpu_check_{gpu.lower()}.json"
    report = Report(out, args.budget_s)
    if args.work_dir:
        work = Path(args.work_dir)
        work.mkdir(parents=True, exist_ok=True)
    else:
        work = Path(tempfile.mkdtemp(prefix="pdcluster-gpu-check-"))
    try:
        return run_sections(args, report, work)
    finally:
        # The models built here are hundreds of MB each: never leave them in /tmp, failed or not.
        shutil.rmtree(work, ignore_errors=True)


def run_sections(args, report: "Report", work: Path) -> int:
    wanted = set(args.sections.split(","))
    with report.section("env", 0) as entry:
        if entry is not None:
            env_section(entry, args.device)
    kernel_tests = None
    if "kernel_tests" in wanted:
        kernel_tests = start_kernel_tests(args.device, report.left_s(), work, args.simulate_gpu_box)
    if "correctness" in wanted:
        with report.section("correctness", 60) as entry:
            if entry is not None:
                if args.in_process:
                    def progress() -> None:
                        report.write()
                        if args.crash_in and entry.get("in_progress") == args.crash_in:
                            os._exit(134)  # as a process that aborts on a CUDA error does

                    correctness_section(entry, args.device, work, args.quick,
                                        set(args.models.split(",")) if args.models else None, progress)
                else:
                    isolated_correctness(entry, args, report, work)
    if kernel_tests is not None:  # done before the timings: they must have the GPU to themselves
        with report.section("kernel_tests", 0) as entry:
            if entry is not None:
                finish_kernel_tests(entry, kernel_tests, args.device)
    if "speed" in wanted:
        with report.section("speed", 60) as entry:
            if entry is not None:
                entry["device"] = report.data["sections"]["env"].get("device", "")
                speed_section(entry, args.device, work, args.quick, report)
    if "deterministic" in wanted:
        with report.section("deterministic", 60) as entry:
            if entry is not None:
                deterministic_section(entry, args.device, work, args.quick)
    print(json.dumps(report.data, indent=2))
    return 0 if all(s.get("ok", True) for s in report.data["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
