#!/bin/bash
# One device call for a GPU session (bench/gpu_check.py, bench/prefill_attention.py, with GPU_SERVE=1 the served
# throughput by --api-servers (bench/gpu_serve.py; GPU_SERVE_ONLY=1: that alone, ~3 minutes), and with GPU_SWEEP=1 or
# GPU_SWEEP=<sections> bench/attention_sweep.py, with GPU_MLA=1 DeepSeek's latent attention (its kernel's sweep and
# bench/deepseek_mla.py on CUDA), with GPU_GEMM=1 bench/gemm_sweep.py, with GPU_PROFILE=1 a quick
# `pdcluster profile --device cuda`, and the host's Python speed: bench/host_overhead.py and
# bench/event_codec.py), within one
# command's 10 minutes: results go to $OUT (what comes back) and their logs' tails to the output.
#
# Here, first (the GPU machine lacks pyzmq and the HTTP stack, and downloads nothing; the tokenizer files are
# ignored by git):
#   python bench/gpu_check.py --prepare-assets
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 -d .whl pyzmq==27.3.0 pillow==13.0.0   # .whl/ in .git/info/exclude
#   (Pillow: gpu_check's image prompts on a tiny LLaVA; the machine's transformers needs it for the image processor)
#   # GPU_SERVE only: the serving stack, at the versions the tests run (9.7 MB with pyzmq)
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#       fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 httptools==0.9.0 uvloop==0.23.0 prometheus_client==0.26.0 \
#       httpx==0.28.1 httpcore==1.0.9 Jinja2==3.1.6 MarkupSafe==3.0.4 pydantic==2.14.4 pydantic_core==2.50.5 \
#       anyio==4.16.0 idna==3.20 sniffio==1.3.1 typing_extensions==4.16.0 annotated-types==0.8.0 \
#       typing-inspection==0.4.5 click==8.5.1 h11==0.16.0 certifi==2026.10.19.post1 \
#       opentelemetry-api==1.45.2   # fastapi 0.165 imports it (the H200 machine of s51 lacked it)
#   python bench/gpu_check.py --device cpu --quick --simulate-gpu-box   # the dry run
#   python bench/gpu_serve.py --device cpu --quick --api-servers 1,2 --num-prompts 32 --concurrency 16 --output-len 16
# Then the device call: command `bash bench/gpu_session.sh`, carry ["bench/gpu_assets", ".whl"], timeout_s 590.
set -o pipefail
OUT=${OUT:-/tmp/gpu_session}
# Each part's timeout is cut to what is left of GPU_SESSION_S (default 570 of the device call's 590 s; the parts'
# own limits add up to more), so the script ends with its summary lines before the call's limit kills it.
session_end=$(( SECONDS + ${GPU_SESSION_S:-570} ))
cap() {  # cap MAX_S: MAX_S, or the seconds left if fewer (at least 1: `timeout 0` would mean no limit)
    local left=$(( session_end - SECONDS ))
    [ "$left" -lt 1 ] && left=1
    echo $(( $1 < left ? $1 : left ))
}
mkdir -p "$OUT"
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1

# with_tiny_models TIMEOUT_S CODE [ARGS...]: Python CODE (sys and os imported) with pdcluster importable from
# this checkout and PDCLUSTER_CACHE_DIR holding the built tiny models (gpu_check's own helpers).
with_tiny_models() {
    local timeout_s=$1 code=$2
    shift 2
    timeout "$timeout_s" python3 -c "import os, pathlib, sys, tempfile
sys.path.insert(0, 'bench')
from gpu_check import import_pdcluster, model_cache
import_pdcluster()
os.environ['PDCLUSTER_CACHE_DIR'] = str(model_cache(pathlib.Path(tempfile.mkdtemp())))
$code" "$@"
}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
if [ -n "${GPU_SERVE:-}${GPU_SERVE_ONLY:-}" ]; then  # served tok/s and CPU per token by --api-servers
    # GPU_SERVE_MIXED=0,512: each count once eager and once with prefill/mixed steps in piecewise CUDA graphs
    timeout "$(cap 330)" python3 bench/gpu_serve.py --device cuda --api-servers "${GPU_SERVE_COUNTS:-1,2,4}" --num-prompts 384 \
        --mixed-cuda-graph-tokens "${GPU_SERVE_MIXED:-0}" --out "$OUT/gpu_serve.json" > "$OUT/gpu_serve.log" 2>&1
    echo "gpu_serve rc=$?"
    grep -E '"(output_throughput|us_per_output_token|api_processes_us_per_output_token|median_tpot_ms|error)"' "$OUT/gpu_serve.json"
    tail -3 "$OUT/gpu_serve.log"
    [ -n "${GPU_SERVE_ONLY:-}" ] && exit 0
fi
# gpu_check stops starting sections past --budget-s (its last full run took 110 s); the sweeps get what
# is left.
# GPU_CHECK_SECTIONS: a shorter rerun (e.g. speed) after a full one; GPU_TESTS: test files to run directly
# (their gpu-marked tests), when gpu_check's kernel_tests section (every gpu test, ~100 s) is left out.
if [ -n "${GPU_TESTS:-}" ]; then
    # shellcheck disable=SC2086
    TRITON_INTERPRET=0 with_tiny_models "$(cap 200)" "import pytest
sys.exit(pytest.main(['-q', '-m', 'gpu', '-p', 'no:cacheprovider', *sys.argv[1:]]))" $GPU_TESTS > "$OUT/gpu_tests.log" 2>&1
    echo "gpu tests rc=$?: $(grep -E '[0-9]+ (passed|failed)' "$OUT/gpu_tests.log" | tail -1)"
fi
gpu_check_s=$(cap 360)
timeout "$gpu_check_s" python3 bench/gpu_check.py --device cuda --budget-s $(( gpu_check_s * 5 / 6 )) --sections "${GPU_CHECK_SECTIONS:-env,kernel_tests,correctness,deterministic,speed}" \
    --out "$OUT/gpu_check.json" > "$OUT/gpu_check.log" 2>&1
echo "gpu_check rc=$?"
echo "checks not ok: $(grep -c '"ok": false' "$OUT/gpu_check.json")"
grep -E '"(x_floor|step_ms|step_ms_synced|mfu|idle_ms_per_step|span_ms_per_step|steps_launched_ahead)"' "$OUT/gpu_check.json" | head -60
timeout "$(cap 120)" python3 bench/prefill_attention.py --out "$OUT/prefill_attention.json" > "$OUT/prefill_attention.log" 2>&1
echo "prefill_attention rc=$?"
grep -E '"(best|ms|tflops|error)"' "$OUT/prefill_attention.json"
if [ -n "${GPU_SWEEP:-}" ]; then  # the Triton kernels' tile sweeps (bench/results/attention_sweep_h100.json)
    sweep_sections=$([ "$GPU_SWEEP" = 1 ] && echo decode,decode_many || echo "$GPU_SWEEP")
    timeout "$(cap 200)" python3 bench/attention_sweep.py --sections "$sweep_sections" --out "$OUT/attention_sweep.json" > "$OUT/attention_sweep.log" 2>&1
    echo "attention_sweep rc=$?"
    # each case's production time and its best (decode_many: the uniform launch and the pipeline stages too)
    grep -E '^decode_(few|many) ' "$OUT/attention_sweep.log" | grep -E "'(production|production_uniform)'" | cut -c1-160
    grep -A8 '"best"' "$OUT/attention_sweep.json" | grep -E '"(kind|block_n|segments|num_stages|us)"' | tr -s ' \n' ' '
    echo
fi
if [ -n "${GPU_MLA:-}" ]; then  # DeepSeek's latent attention: the kernel's tile sweep and a V2-Lite-shaped engine
    timeout "$(cap 150)" python3 bench/attention_sweep.py --sections mla --out "$OUT/mla_sweep.json" > "$OUT/mla_sweep.log" 2>&1
    echo "mla_sweep rc=$?"
    grep -A12 '"best"' "$OUT/mla_sweep.json" | grep -E '"(kind|heads_block|block_n|num_warps|num_stages|us|latent_tb_per_s)"' | tr -s ' \n' ' '
    echo
    with_tiny_models "$(cap 150)" "sys.argv = ['deepseek_mla.py', *sys.argv[1:]]
import deepseek_mla
deepseek_mla.main()" --device cuda --dtype bfloat16 --batches 1 32 128 --prompt-len 512 --new-tokens 64 \
        --out "$OUT/deepseek_mla_gpu.json" > "$OUT/deepseek_mla.log" 2>&1
    echo "deepseek_mla rc=$?: $(grep -E '"(decode_step_ms|decode_over_transformers|cuda_graphs)"' "$OUT/deepseek_mla_gpu.json" | tr -s ' \n' ' ')"
fi
if [ -n "${GPU_GEMM:-}" ]; then  # decode-sized GEMMs: cuBLAS, cuBLASLt, pre-transposed, the skinny Triton tiles
    timeout "$(cap 180)" python3 bench/gemm_sweep.py --out "$OUT/gemm_sweep.json" > "$OUT/gemm_sweep.log" 2>&1
    echo "gemm_sweep rc=$?"
    grep -E '"best"' "$OUT/gemm_sweep.json" | sort | uniq -c
fi
if [ -n "${GPU_PROFILE:-}" ]; then  # `pdcluster profile --device cuda --quick` on the tiny model (planner inputs)
    with_tiny_models "$(cap 240)" "from pdcluster.cli.main import main
sys.exit(main(['profile', '--model', 'tiny-random', '--quick', '--device', os.environ.get('GPU_PROFILE_DEVICE', 'cuda'),
    '--out', sys.argv[1]]))" "$OUT/profile_tiny.json" > "$OUT/profile.log" 2>&1
    echo "profile rc=$?: $(tail -1 "$OUT/profile.log" | cut -c1-300)"
fi
# The host's own speed (the GPU machines' hosts differed 2-4x in one session): the engine's Python per decode
# step with the model stubbed (bench/host_overhead.py), synchronous and async, beside this machine's figures; the
# async run on the GPU decode path's Python as the CPU sessions measure it, split into phases (bench/host_phases.py).
for flag in "" "--async-scheduling --graph-path --streaming-outputs --phases"; do
    with_tiny_models "$(cap 90)" "sys.argv = ['host_overhead.py', *sys.argv[1:]]
import host_overhead
sys.exit(host_overhead.main())" --batches 1,128 --steps 100 $flag --out "$OUT/host_overhead${flag:+_async}.json" \
        >> "$OUT/host_overhead.log" 2>&1
    echo "host_overhead ${flag:-sync} rc=$?: $(grep -A1 '"128"' "$OUT/host_overhead${flag:+_async}.json" | tail -1)"
done
# And a decode step's worker -> router events at batch 128 on this host (bench/event_codec.py, msgpack only).
timeout "$(cap 60)" python3 bench/event_codec.py --n 5000 --repeats 3 --out "$OUT/event_codec.json" > "$OUT/event_codec.log" 2>&1
echo "event_codec rc=$?: $(grep -A3 '"step_tokens"' "$OUT/event_codec.json" | tr -s ' \n' ' ')"
tail -5 "$OUT/gpu_check.log"
