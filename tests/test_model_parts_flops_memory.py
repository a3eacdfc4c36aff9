"""Model-part breakdown, FLOP rates and memory categories on the real H200 fixtures (issue 17)."""
import gzip
import json

import numpy as np
import pytest
import torch

from sftprof.capture import module_regions
from sftprof.analysis.memory.snapshot import analyze_snapshot
from sftprof.analysis.memory.safe_pickle import safe_load_file
from sftprof.analysis.time.collectives import bus_factor
from sftprof.analysis.trace.op_collector import OpCollector
from sftprof.analysis.time.op_flops import attention_pairs, op_flops
from sftprof.analysis.time.trace_summary import KernelTraceAnalyzer
from tests.fixtures import gpu_snapshot_fixtures, gpu_trace_fixtures
from tests.fixtures.qwen3_5 import gated_delta_rule_reference

TRACES = {p.name: p for p in gpu_trace_fixtures()}
SFTPROF_TRACE = "h200_sftprof_kernel.trace.json.gz"


def _load(path):
    with gzip.open(path, "rt") as f:
        return json.load(f)


@pytest.fixture(scope="module", params=sorted(TRACES))
def analysed(request):
    data = _load(TRACES[request.param])
    a = KernelTraceAnalyzer({k: v for k, v in data.items() if k != "traceEvents"})
    for ev in data["traceEvents"]:
        a.add(ev)
    return request.param, data["traceEvents"], a.summary()


def test_parts_sum_to_the_steps_gpu_time(analysed):
    name, events, s = analysed
    # Independently: GPU activities whose launching runtime call lies in the step window.
    lo, hi = s["step_window"]["start_us"], s["step_window"]["end_us"]
    launch = {e["args"]["correlation"]: e["ts"] for e in events
              if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in (e.get("args") or {})}
    gpu_us = sum(e["dur"] for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
                 and lo <= launch.get(e["args"].get("correlation"), -1) <= hi)
    assert gpu_us > 0
    cells = sum(r["total_ms"] for r in s["parts"]["summed"])
    assert cells == pytest.approx(gpu_us / 1e3, rel=0.01)
    assert s["parts"]["total_ms"] == pytest.approx(gpu_us / 1e3, rel=1e-6)
    phases = sum(r[f"{p}_ms"] for r in s["parts"]["summed"] for p in ("forward", "recompute", "backward", "optimizer", "other"))
    assert phases == pytest.approx(cells, rel=1e-4)


def test_attention_flop_rate_matches_the_hand_computed_one():
    data = _load(TRACES[SFTPROF_TRACE])
    a = KernelTraceAnalyzer({k: v for k, v in data.items() if k != "traceEvents"})
    for ev in data["traceEvents"]:
        a.add(ev)
    rows = [r for r in a.summary()["efficiency"]["rows"] if r["kind"] == "attention"]
    # 2 layers, full recompute: 2 first-pass forwards, 2 recomputes (inside CheckpointFunctionBackward), 2 backwards.
    by_phase = {r["phase"]: r for r in rows}
    assert sorted(by_phase) == ["backward", "forward", "recompute"]
    assert [by_phase[p]["calls"] for p in ("forward", "recompute", "backward")] == [2, 2, 2]
    # q [1, 32, 4096, 128], causal: 4 * b * h * d * s (s + 1) / 2 per call.
    per_call = 4 * 1 * 32 * 128 * 4096 * 4097 // 2
    assert by_phase["forward"]["tflop"] == pytest.approx(2 * per_call / 1e12, abs=1e-6)
    assert by_phase["backward"]["tflop"] == pytest.approx(2 * 2 * per_call / 1e12, abs=1e-6)
    # The rate is the FLOPs over the GPU time of the kernels the SDPA ops launched (cuDNN fprop here).
    fprop_us = sum(e["dur"] for e in data["traceEvents"] if e.get("cat") == "kernel" and "flash_fprop" in e["name"])
    fwd_ms = by_phase["forward"]["gpu_ms"] + by_phase["recompute"]["gpu_ms"]
    assert fwd_ms == pytest.approx(fprop_us / 1e3, rel=1e-3)
    rate = 2 * per_call / (by_phase["forward"]["gpu_ms"] * 1e-3) / 1e12
    assert by_phase["forward"]["tflops_per_s"] == pytest.approx(rate, rel=1e-3)
    assert by_phase["forward"]["pct_of_peak"] == pytest.approx(100 * rate / 989.4, rel=1e-3)


def test_op_flops_for_known_shapes():
    assert op_flops("aten::mm", {"Input Dims": [[8192, 2048], [2048, 5120]], "Input type": ["c10::BFloat16"] * 2}) \
        == ("GEMM", 2.0 * 8192 * 2048 * 5120, "BFloat16")
    assert op_flops("aten::addmm", {"Input Dims": [[5120], [64, 2048], [2048, 5120]], "Input type": ["float"] * 3}) \
        == ("GEMM", 2.0 * 64 * 2048 * 5120, "float")
    # grouped experts: tokens [T, h] x weights [E, h, 2f]; weight gradient [h, T] x [T, 2f] grouped over T
    assert op_flops("aten::_grouped_mm", {"Input Dims": [[1000, 2048], [16, 2048, 1536], [16]]})[1] == 2.0 * 1000 * 2048 * 1536
    assert op_flops("aten::_grouped_mm", {"Input Dims": [[2048, 1000], [1000, 1536], [16]]})[1] == 2.0 * 2048 * 1000 * 1536
    masked = {"Input Dims": [[1, 32, 64, 128], [1, 4, 128, 128], [1, 4, 128, 128], [64, 128]],
              "Concrete Inputs": ["", "", "", "", "0.", "False", "", "True"]}
    assert op_flops("aten::scaled_dot_product_attention", masked) is None
    assert attention_pairs(4, 4, True) == 10 and attention_pairs(4, 2, True) == 3 + 2 * 2 and attention_pairs(3, 5, False) == 15
    for sq in range(1, 7):
        for sk in range(1, 7):
            for lower_right in (False, True):
                shift = sk - sq if lower_right else 0
                brute = sum(1 for i in range(sq) for j in range(sk) if j <= i + shift)
                assert attention_pairs(sq, sk, True, lower_right) == brute, (sq, sk, lower_right)
    # a context-parallel chunk through xformers-style efficient attention: q [b, s, h, d], lower-right mask (2)
    eff = {"Input Dims": [[1, 2048, 32, 128], [1, 6144, 32, 128], [1, 6144, 32, 128], [], [], [], [], [], [], [], [], []],
           "Concrete Inputs": ["", "", "", "", "", "", "", "", "0.", "2", "True", ""], "Input type": ["c10::BFloat16"] * 3}
    pairs = 2048 * 6144 - 2048 * 2047 // 2
    assert op_flops("aten::_efficient_attention_forward", eff) == ("attention", 4.0 * 32 * 128 * pairs, "BFloat16")
    # the CP "blocks" path calls cuDNN's private SDPA ops directly (args as recorded on an H200: rank 0's diagonal
    # block of 32768 queries, causal, and its off-diagonal block against 98304 earlier keys, GQA K/V of 4 heads)
    bf16 = ["c10::BFloat16"] * 3
    diag = {"Input Dims": [[1, 32, 32768, 128], [1, 4, 32768, 128], [1, 4, 32768, 128], [], [], [], [], [], []],
            "Concrete Inputs": ["", "", "", "", "True", "0.", "True", "False", "0.088388347648318447"], "Input type": bf16}
    assert op_flops("aten::_scaled_dot_product_cudnn_attention", diag) == (
        "attention", 4.0 * 32 * 128 * (32768 * 32769 // 2), "BFloat16")
    off_bwd = {"Input Dims": [[1, 32, 32768, 128], [1, 32, 32768, 128], [1, 4, 98304, 128], [1, 4, 98304, 128],
                              [1, 32, 32768, 128], [1, 32, 32768, 1]] + [[]] * 10,
               "Concrete Inputs": [""] * 11 + ["32768", "98304", "0.", "False", "0.088388347648318447"], "Input type": bf16}
    assert op_flops("aten::_scaled_dot_product_cudnn_attention_backward", off_bwd) == (
        "attention backward", 2 * 4.0 * 32 * 128 * 32768 * 98304, "BFloat16")
    assert bus_factor("all_reduce", 4) == 1.5 and bus_factor("all_to_all", 2) == 0.5 and bus_factor("broadcast", 8) == 1.0


@pytest.mark.parametrize("path", gpu_snapshot_fixtures(), ids=lambda p: p.name)
def test_memory_categories_sum_to_the_allocated_bytes_at_the_peak(path):
    s = analyze_snapshot(safe_load_file(str(path)))
    cats = {r["category"]: r for r in s["categories_at_peak"]}
    assert sum(r["bytes"] for k, r in cats.items() if k != "allocator_slack") == s["peak_allocated_bytes"]
    assert cats["allocator_slack"]["bytes"] == s["reserved_at_peak_bytes"] - s["peak_allocated_bytes"]
    if path.name == "h200_sftprof_memory.snapshot.pickle.gz":
        # The optimizer step holds the fp32 gradient copy (copy_group_grads) and Adam's state there.
        assert cats["optimizer"]["bytes"] == sum(t["bytes"] for t in s["top_sites"] if "megatron/core/optimizer/" in t["site"])
        assert cats["optimizer"]["blocks"] == 33


def test_module_part_names():
    assert module_regions.module_part("decoder.layers.3.self_attention.linear_qkv") == ("attn_qkv", 3)
    assert module_regions.module_part("decoder.layers.3.mlp") == ("dispatch_combine", 3)
    assert module_regions.module_part("decoder.layers.3.mlp.experts.linear_fc1") is None
    assert module_regions.module_part("module.output_layer") == ("lm_head_loss", None)
    assert module_regions.parse_region(module_regions.region_name("experts", 5, True)) == ("experts", 5, True)
    assert module_regions.parse_region("sftprof.module/nonsense/L1") is None


def test_recorded_step_compiles_nothing_new_and_names_modules_run_inside_a_compiled_method():
    """megatron-core's GatedDeltaNet calls ``out_norm`` inside a torch.compile'd method; where that call runs eagerly
    (a graph break, as in TE's norm), the model-part hooks of a recorded step fired inside the compiled context and
    dynamo compiled them as new frames, once per layer (on the H200: 18 compiles inside the profiled step 2 of
    Qwen3.5, 1418 ms). Now the recorded step compiles no frame and still names each layer's norm."""
    from torch._dynamo.utils import counters

    class Norm(torch.nn.LayerNorm):
        def forward(self, x):
            torch._dynamo.graph_break()  # runs eagerly inside the compiled method, like TE's RMSNorm
            return super().forward(x)

    class GatedDeltaNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.out_norm = Norm(8)

        @torch.compile(backend="eager")
        def gated_norm(self, x):
            return self.out_norm(x.float()) * torch.sigmoid(x)

        def forward(self, x):
            return self.gated_norm(x)

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(torch.nn.Module() for _ in range(3))
    for layer in model.layers:
        layer.self_attention = GatedDeltaNet()

    def step():
        x = torch.randn(4, 8, requires_grad=True)
        for layer in model.layers:
            x = layer.self_attention(x)
        x.sum().backward()

    assert module_regions.register_model(model) == 9  # per layer: the layer, its GatedDeltaNet, out_norm
    step()  # compiles
    frames = counters["frames"]["total"]
    with torch.profiler.profile() as prof, module_regions.recording():
        step()
    assert counters["frames"]["total"] == frames
    names = {e.name for e in prof.events() if e.name.startswith(module_regions.PREFIX)}
    assert names == {module_regions.region_name(part, layer, False) for part in ("linear_attn", "norm")
                     for layer in range(3)}


def test_gpu_idle_split_and_busy_make_up_the_window(analysed):
    _, _, s = analysed
    idle = s["host"]["gpu_idle"]
    assert idle["host_wait_ms"] + idle["kernel_wait_ms"] + idle["after_last_activity_ms"] == pytest.approx(idle["idle_ms"], abs=1e-3)
    assert idle["idle_ms"] + s["gpu"]["busy_ms"] == pytest.approx(s["step_window"]["wall_ms"], abs=2e-3)


def test_nvidia_smi_utilisation_inside_the_profiled_window(tmp_path):
    import datetime

    from sftprof.analysis.trial.inputs import read_nvidia_smi, smi_in_window

    t0 = datetime.datetime(2026, 11, 29, 23, 2, 19)
    rows = ["timestamp, index, utilization.gpu [%], memory.used [MiB], memory.total [MiB]"]
    for k, util in enumerate([0, 10, 90, 100, 95, 5]):  # one sample every 0.5 s
        stamp = (t0 + datetime.timedelta(seconds=0.5 * k)).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
        rows.append(f"{stamp}, 0, {util}, {1000 + k}, 143771")
    path = tmp_path / "nvidia_smi.csv"
    path.write_text("\n".join(rows) + "\n")
    smi = read_nvidia_smi(str(path))
    assert smi["gpus"][0]["mean_utilization_pct"] == 50.0  # whole trial
    got = smi_in_window(smi, t0.timestamp() + 0.9, t0.timestamp() + 2.1)  # samples 2, 3, 4
    assert got["gpus"] == [{"index": 0, "samples": 3, "mean_utilization_pct": 95.0, "peak_utilization_pct": 100.0,
                            "peak_memory_used_mib": 1004.0}]


def test_theoretical_memory_of_the_4_layer_qwen3_30b_a3b_slice():
    from sftprof.allocation import parse_allocation_mode
    from sftprof.models.hf import load_hf_config
    from sftprof.analysis.memory.estimate import estimate_memory

    hf = load_hf_config("qwen3_30b_a3b", 4)
    cfg = {"actor": {"dtype": "bfloat16", "megatron": {"use_precision_aware_optimizer": False, "lm_head_loss_chunk_size": 0,
                                                         "ddp": {"use_distributed_optimizer": True}}}}
    one = parse_allocation_mode("megatron:d1")
    est = estimate_memory(cfg, hf, one, one.rank_coords(0), 131072)
    # per layer: attention 2048*(32+8)*128 + 4096*2048, norms 2*2048 + 2*128, router 2048*128; experts 128*3*2048*768
    layer_dense = 2048 * 40 * 128 + 4096 * 2048 + 2 * 2048 + 2 * 128 + 2048 * 128
    assert est["params_dense"] == 4 * layer_dense + 2 * 151936 * 2048 + 2048
    assert est["params_expert"] == 4 * 128 * 3 * 2048 * 768
    n = est["params_dense"] + est["params_expert"]  # 3,114,814,464 (3.115 B)
    rows = {r["category"]: r["bytes"] for r in est["rows"]}
    assert (rows["parameters"], rows["gradients"], rows["optimizer"]) == (2 * n, 2 * n, 16 * n)
    assert rows["activations"] == 4 * 131072 * 2048 * 2 + 131072 * 151936 * 2
    # CP2 + EP2 on two GPUs: each rank keeps half the experts, the distributed optimizer shards dense state over 2
    two = parse_allocation_mode("megatron:(attn:c2|ffn:e2)")
    est2 = estimate_memory(cfg, hf, two, two.rank_coords(1), 131072)
    assert est2["params_expert"] == est["params_expert"] // 2
    opt = {r["category"]: r["bytes"] for r in est2["rows"]}["optimizer"]
    assert opt == 16 * est2["params_dense"] // 2 + 16 * est2["params_expert"]
    # the 1x H200 memory trial of this slice (bench/NOTES.md) measured 12 B/param of optimizer state at a peak in
    # the forward: the report says the fp32 gradient copy (4 B/param) is the difference
    from sftprof.analysis.memory import estimate as memory_estimate
    from sftprof.analysis.report import memory as report_memory

    measured = {"categories_at_peak": [{"category": "optimizer", "bytes": 12 * n}]}
    cmp_rows = memory_estimate.explain_estimate(measured, est)
    assert report_memory._step_copy_note(cmp_rows, est) == (
        " Optimizer: the measured state is the estimate less the fp32 gradient copy (11.60 GiB), which megatron-core's "
        "optimizers make in the optimizer step (`_copy_model_grads_to_main_grads`): this peak is outside it.")
    measured["categories_at_peak"][0]["bytes"] = 16 * n
    assert report_memory._step_copy_note(memory_estimate.explain_estimate(measured, est), est) == ""


def test_torch_compile_inside_the_step_is_measured_and_named(tmp_path):
    """A real CPU trace whose step compiles a function (first call) and one that reuses it: the compile time is
    the union of dynamo's ops in the step, and it becomes the heaviest finding."""
    from sftprof.analysis.report import findings

    f = torch.compile(lambda x: torch.sin(x) * 2, backend="eager")
    summaries = []
    for i in range(2):  # step 0 compiles, step 1 reuses the compiled code
        with torch.profiler.profile() as prof:
            with torch.profiler.record_function("sftprof/step"):
                f(torch.randn(64))
        path = tmp_path / f"step{i}.json"
        prof.export_chrome_trace(str(path))
        data = json.loads(path.read_text())
        a = KernelTraceAnalyzer({k: v for k, v in data.items() if k != "traceEvents"})
        for ev in data["traceEvents"]:
            a.add(ev)
        summaries.append((data["traceEvents"], a.summary()))
    events, s = summaries[0]
    outer = [e for e in events if e.get("cat") == "cpu_op" and e["name"] == "dynamo"]
    assert len(outer) == 1 and s["host"]["compile"]["ms"] == pytest.approx(outer[0]["dur"] / 1e3, abs=1e-3)
    ids = s["host"]["compile"]["compile_ids"]  # dynamo numbers frames per process: "<frame>/0", first compile
    assert len(ids) == 1 and ids[0].endswith("/0")
    found = findings.kernel_findings(0, s)
    wall = s["step_window"]["wall_ms"]
    assert [f["text"] for f in found if f["key"] == "compile"] == [
        f"rank 0: torch.compile compiled inside the profiled step: {s['host']['compile']['ms']:.1f} ms of its "
        f"{wall:.1f} ms wall time in dynamo/inductor (1 compile(s): {ids[0]}); the step time includes it, so this "
        "step is not steady state: profile a later step (PROFILE_STEPS)"]  # a CPU trace: no GPU idle named
    assert s["gpu"]["activities"] == 0
    assert summaries[1][1]["host"]["compile"] == {"ms": 0.0, "compile_ids": []}



def _idle_places_trace() -> list[dict]:
    """A hand-built step (times in units of 10 us): a MoE router forward whose second kernel waits for the host
    after an ``aten::nonzero`` sync; an LM-head loss Function whose forward (20 kernels) and backward (10 kernels)
    are launch-bound loops of short kernels; one kernel launched after long host work. Host thread 1, autograd
    thread 2, GPU stream 7."""
    u = 10.0
    evs: list[dict] = []

    def x(cat, name, ts, dur, tid=1, pid=100, **args):
        evs.append({"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts * u, "dur": dur * u,
                    "args": args})

    def launch(corr, at, start, dur, tid=1, op="aten::add"):
        x("cpu_op", op, at - 1, 6, tid)
        x("cuda_runtime", "cudaLaunchKernel", at, 1, tid, correlation=corr)
        x("kernel", f"k{corr}", start, dur, 7, 0, correlation=corr)

    x("user_annotation", "sftprof/step", 0, 480)
    x("user_annotation", "sftprof.module/router/L0", 10, 150)
    x("cpu_op", "aten::nonzero", 20, 100)
    x("cuda_runtime", "cudaLaunchKernel", 22, 3, correlation=1)
    x("kernel", "k1", 30, 50, 7, 0, correlation=1)  # 30 idle before it
    x("cuda_runtime", "cudaStreamSynchronize", 26, 56, correlation=2)  # returns at 82, 2 after the GPU drained
    launch(3, 135, 140, 30, op="aten::index")  # gap 80-140 after the sync
    x("user_annotation", "sftprof.module/lm_head_loss", 170.5, 160)
    x("cpu_op", "_VocabParallelLogprobs", 170.5, 159)
    evs.append({"ph": "s", "cat": "fwdbwd", "name": "fwdbwd", "id": 5, "pid": 100, "tid": 1, "ts": 170.5 * u})
    for k in range(20):  # kernels of 2 launched every 8: gaps 3, then 6
        launch(10 + k, 172 + 8 * k, 173 + 8 * k, 2)
    x("cpu_op", "autograd::engine::evaluate_function: _VocabParallelLogprobsBackward", 330, 90, 2)
    x("cpu_op", "_VocabParallelLogprobsBackward", 330.5, 89, 2)
    evs.append({"ph": "f", "bp": "e", "cat": "fwdbwd", "name": "fwdbwd", "id": 5, "pid": 100, "tid": 2, "ts": 330.5 * u})
    for k in range(10):  # kernels of 4 launched every 8: gaps 6, then 4
        launch(40 + k, 332 + 8 * k, 333 + 8 * k, 4, tid=2, op="aten::mul")
    launch(60, 459, 460, 10, op="aten::sum")  # 409-460: the host worked elsewhere
    return evs


def test_gpu_idle_waiting_for_the_host_by_place():
    """Each host-wait gap goes to the place of the activity that ends it; the gap after the sync is 'after
    blocking calls', the loops are launch-bound, the long gap is host busy; the HTA-style totals are unchanged."""
    from sftprof.analysis.report import findings, trace as report_trace

    a = KernelTraceAnalyzer({})
    for ev in _idle_places_trace():
        a.add(ev)
    s = a.summary()
    idle = s["host"]["gpu_idle"]
    # host wait (x 10 us): 30 before k1 + 60 after the sync + 3 + 19 x 6 in the forward loop + 6 + 9 x 4 in the
    # backward loop + 51; busy 50 + 30 + 20 x 2 + 10 x 4 + 10 = 170 of the 480 window
    assert {k: v for k, v in idle.items() if k != "host_wait_by_place"} == {
        "idle_ms": 3.1, "host_wait_ms": 3.0, "kernel_wait_ms": 0.0, "after_last_activity_ms": 0.1}
    assert s["gpu"]["busy_ms"] == 1.7
    places = idle["host_wait_by_place"]
    lm = {"part": "lm_head_loss", "label": "LM head + loss", "after_blocking_ms": 0.0, "after_blocking_pct": 0.0,
          "kind": "launch-bound"}
    assert places["rows"] == [
        {**lm, "phase": "forward", "launched_under": "_VocabParallelLogprobs", "idle_ms": 1.17, "gaps": 20,
         "activities": 20, "mean_activity_us": 20.0, "mean_gap_us": 58.5, "longest_gap_us": 60.0},
        {"part": "router", "label": "MoE router", "phase": "forward", "launched_under": None, "idle_ms": 0.9,
         "gaps": 2, "activities": 2, "mean_activity_us": 400.0, "mean_gap_us": 450.0, "longest_gap_us": 600.0,
         "after_blocking_ms": 0.6,
         "after_blocking_pct": 66.667, "kind": "after blocking calls"},
        {"part": "outside_parts", "label": "outside model parts (loss, glue, unlinked backward)", "phase": "other",
         "launched_under": None, "idle_ms": 0.51, "gaps": 1, "activities": 1, "mean_activity_us": 100.0,
         "mean_gap_us": 510.0, "longest_gap_us": 510.0, "after_blocking_ms": 0.0, "after_blocking_pct": 0.0,
         "kind": "host busy"},
        {**lm, "phase": "backward", "launched_under": "_VocabParallelLogprobsBackward", "idle_ms": 0.42, "gaps": 10,
         "activities": 10, "mean_activity_us": 40.0, "mean_gap_us": 42.0, "longest_gap_us": 60.0}]
    assert (places["rest"], places["after_blocking_ms"], places["after_blocking_by_op"]) == (
        None, 0.6, {"aten::nonzero": 0.6})
    found = findings.kernel_findings(0, s)
    assert [f["text"] for f in found if f["key"] == "gpu idle"] == [
        "rank 0: GPU idle 3.1 ms (64.6 % of the step's wall time), 3.0 ms of it waiting for the host to launch work: "
        "1.2 ms in LM head + loss, phase forward, under _VocabParallelLogprobs (launch-bound: 20 GPU activities "
        "averaging 20.0 µs, 20 gaps averaging 58.5 µs); 0.9 ms in MoE router, phase forward (67 % of it after "
        "blocking CUDA calls); 0.6 ms of the wait follows blocking CUDA calls (aten::nonzero 0.6 ms)"]
    md = "".join(report_trace._host(s, 0))
    assert ("| part | phase | launched under | idle ms | gaps | mean gap µs | longest gap µs | GPU activities | mean µs | "
            "after blocking call % | kind |\n|---|---|---|---|---|---|---|---|---|---|---|\n"
            "| LM head + loss | forward | _VocabParallelLogprobs | 1.170 | 20 | 58.500 | 60.000 | 20 | 20.000 | 0.000 | "
            "launch-bound |\n"
            "| MoE router | forward | – | 0.900 | 2 | 450.000 | 600.000 | 2 | 400.000 | 66.667 | after blocking calls |\n"
            "| outside model parts (loss, glue, unlinked backward) | other | – | 0.510 | 1 | 510.000 | 510.000 | 1 | "
            "100.000 | 0.000 | host busy |\n"
            "| LM head + loss | backward | _VocabParallelLogprobsBackward | 0.420 | 10 | 42.000 | 60.000 | 10 | 40.000 | "
            "0.000 | launch-bound |\n"
            "Idle after blocking CUDA calls: 0.600 ms (aten::nonzero 0.600 ms).\n") in md



def test_garbage_collection_inside_the_host_wait_is_named():
    """The same step with three collection ranges (units of 10 us): gen 1 at 50-52 while k1 runs (host time, no GPU
    wait), gen 2 at 420-450 inside the 409-460 host-busy gap, gen 0 at 481-482 after the step window (not counted):
    the host-wait place of that gap carries its 300 us of collection, and the host section and the place's words
    say so."""
    from sftprof.analysis.report import findings, trace as report_trace

    u = 10.0
    a = KernelTraceAnalyzer({})
    for ev in _idle_places_trace() + [
            {"ph": "X", "cat": "user_annotation", "name": f"sftprof.gc/gen{g}", "pid": 100, "tid": 1, "ts": t0 * u,
             "dur": (t1 - t0) * u, "args": {}} for g, t0, t1 in ((1, 50, 52), (2, 420, 450), (0, 481, 482))]:
        a.add(ev)
    s = a.summary()
    assert s["host"]["gc"] == {"collections": 2, "ms": 0.32, "by_generation": {"1": 1, "2": 1}}
    idle = s["host"]["gpu_idle"]
    assert idle["host_wait_gc_ms"] == 0.3 and idle["host_wait_ms"] == 3.0
    rows = idle["host_wait_by_place"]["rows"]
    assert [(r["part"], r["phase"], r["gc_ms"]) for r in rows] == [
        ("lm_head_loss", "forward", 0.0), ("router", "forward", 0.0), ("outside_parts", "other", 0.3),
        ("lm_head_loss", "backward", 0.0)]
    assert findings._idle_place(rows[2]) == (
        "0.5 ms in outside model parts (loss, glue, unlinked backward), phase other (host busy: 1 GPU activities "
        "averaging 100.0 µs, 1 gap averaging 510.0 µs, 300.0 µs of the wait in Python garbage collection)")
    assert ("Python garbage collection in the step window: 2 collection(s) (gen 1 1x, gen 2 1x), 0.320 ms of host "
            "time; 0.300 ms of the GPU's host wait fell in a collection. A collection stops every Python thread.\n"
            ) in report_trace._host(s, 0)


def test_garbage_collection_ranges_recorded_twice_overlapping_or_across_the_window_count_once():
    """A damaged or cut record: the gen 2 range at 420-450 twice (one dropped, counted as a duplicate), a gen 0 range
    inside it (its time counted once), a gen 1 range from -5 to 3 (it overlaps the window 0-480: counted, 30 us of it
    inside, all in the first host-wait gap 0-30) and a range with a non-ASCII digit (not a collection range)."""
    u = 10.0
    a = KernelTraceAnalyzer({})
    for ev in _idle_places_trace() + [
            {"ph": "X", "cat": "user_annotation", "name": f"sftprof.gc/gen{g}", "pid": 100, "tid": 1, "ts": t0 * u,
             "dur": (t1 - t0) * u, "args": {}}
            for g, t0, t1 in ((2, 420, 450), (2, 420, 450), (0, 430, 440), (1, -5, 3), ("\u00b2", 100, 200))]:
        a.add(ev)
    s = a.summary()
    assert s["host"]["gc"] == {"collections": 3, "ms": 0.33, "by_generation": {"0": 1, "1": 1, "2": 1}}
    idle = s["host"]["gpu_idle"]
    assert idle["host_wait_gc_ms"] == 0.33
    assert {(r["part"], r["phase"]): r["gc_ms"] for r in idle["host_wait_by_place"]["rows"]} == {
        ("lm_head_loss", "forward"): 0.0, ("router", "forward"): 0.03, ("outside_parts", "other"): 0.3,
        ("lm_head_loss", "backward"): 0.0}
    assert s["sanity"]["duplicates_by_category"] == {"user_annotation": 1}

def _expert_place_summary(starts: list[float], kernel_us: float, step_us: float) -> dict:
    """The summary of a step of ``step_us`` whose expert range (all but the last 1000 us) launches one kernel of
    ``kernel_us`` at each of ``starts`` (us), each launch 2 us before its kernel."""
    evs = [{"ph": "X", "cat": "user_annotation", "name": "sftprof/step", "pid": 100, "tid": 1, "ts": 0.0,
            "dur": step_us, "args": {}},
           {"ph": "X", "cat": "user_annotation", "name": "sftprof.module/experts/L0", "pid": 100, "tid": 1, "ts": 0.0,
            "dur": step_us - 1000.0, "args": {}}]
    for k, start in enumerate(starts):
        evs += [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 100, "tid": 1,
                 "ts": start - 2.0, "dur": 1.0, "args": {"correlation": k + 1}},
                {"ph": "X", "cat": "kernel", "name": f"k{k}", "pid": 0, "tid": 7, "ts": start, "dur": kernel_us,
                 "args": {"correlation": k + 1}}]
    a = KernelTraceAnalyzer({})
    for ev in evs:
        a.add(ev)
    return a.summary()


def test_short_gaps_after_long_kernels_are_host_busy_not_launch_bound():
    """Gaps under LAUNCH_GAP_US after 2 ms kernels (the 1x H200 expert recompute: 2072 us activities, 79 us gaps)
    are not launch-bound, which needs short kernels too: the host, not its launch cost, made the GPU wait; the finding
    gives the activities' length that tells the two apart."""
    from sftprof.analysis.report import findings

    # kernels of 2000 us, each launched 80 us after the previous one ended
    s = _expert_place_summary([100.0 + 2080.0 * k for k in range(4)], 2000.0, 10000.0)
    places = s["host"]["gpu_idle"]["host_wait_by_place"]
    assert places["rows"] == [
        {"part": "experts", "label": "expert GEMMs (routed)", "phase": "forward", "launched_under": None,
         "idle_ms": 0.34, "gaps": 4, "activities": 4, "mean_activity_us": 2000.0, "mean_gap_us": 85.0,
         "longest_gap_us": 100.0, "after_blocking_ms": 0.0, "after_blocking_pct": 0.0, "kind": "host busy"}]
    found = findings.kernel_findings(0, s)  # busy 4 x 2000 us of the 10000 us step
    assert [f["text"] for f in found if f["key"] == "gpu idle"] == [
        "rank 0: GPU idle 2.0 ms (20.0 % of the step's wall time), 0.3 ms of it waiting for the host to launch work: "
        "0.3 ms in expert GEMMs (routed), phase forward (host busy: 4 GPU activities averaging 2.0 ms, 4 gaps "
        "averaging 85.0 µs)"]


def test_one_long_gap_among_short_ones_is_named_a_host_stall():
    """1x H200 with TE, 131072 tokens: one _GroupedLinear call held the host 396 ms with nothing recorded beneath it
    while the GPU waited 376.8 ms, beside a short gap of the same place; the mean (188 ms over 2 gaps) read as launch
    cost. Here: an expert place with gaps of 60 us and 20 ms; the finding names the longest as a host stall."""
    from sftprof.analysis.report import findings

    s = _expert_place_summary([60.0, 20160.0], 100.0, 30000.0)  # gaps 60 us (from the step's start) and 20000 us
    row = s["host"]["gpu_idle"]["host_wait_by_place"]["rows"][0]
    assert (row["label"], row["gaps"], row["mean_gap_us"], row["longest_gap_us"]) == (
        "expert GEMMs (routed)", 2, 10030.0, 20000.0)
    text = next(f["text"] for f in findings.kernel_findings(0, s) if f["key"] == "gpu idle")
    assert ("20.1 ms in expert GEMMs (routed), phase forward (host busy: 2 GPU activities averaging 100.0 µs, 2 gaps "
            "averaging 10.0 ms, the longest 20.0 ms (a host stall, not launch cost))") in text


def test_part_range_marks_work_outside_modules_only_while_recording():
    """The megatron engine's loss on the logits path runs in no module: part_range gives it the LM head's range,
    forward and (inside a backward) recompute-named, and only inside recording()."""
    net = torch.nn.Sequential()
    net.add_module("output_layer", torch.nn.Linear(3, 3))
    assert module_regions.register_model(net) == 1
    x = torch.ones(2, 3, requires_grad=True)

    class _Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 2

        @staticmethod
        def backward(ctx, g):
            with module_regions.part_range("lm_head_loss"):
                return g * 2

    def names(record: bool) -> list[str]:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            with module_regions.recording(record):
                with module_regions.part_range("lm_head_loss"):
                    y = _Twice.apply(net(x)).sum()
                y.backward()
        return [e.name for e in prof.events() if e.name.startswith(module_regions.PREFIX)]

    assert sorted(names(True)) == ["sftprof.module/lm_head_loss", "sftprof.module/lm_head_loss",
                                   "sftprof.module/lm_head_loss/recompute"]
    assert names(False) == []
    with pytest.raises(ValueError, match="part must be one of"):
        with module_regions.part_range("lm_head"):
            pass


def test_place_whose_every_gap_follows_a_blocking_call():
    """A place whose only host-wait gap follows a blocking call (here one gap after ``aten::nonzero``'s sync in the
    router) is 'after blocking calls'; it left no other gap to average, which used to divide by zero and stop the
    summary."""
    evs = [{"ph": "X", "cat": "user_annotation", "name": "sftprof/step", "pid": 100, "tid": 1, "ts": 0.0,
            "dur": 1000.0, "args": {}},
           {"ph": "X", "cat": "user_annotation", "name": "sftprof.module/router/L0", "pid": 100, "tid": 1, "ts": 200.0,
            "dur": 700.0, "args": {}},
           {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 100, "tid": 1, "ts": 5.0, "dur": 1.0,
            "args": {"correlation": 1}},
           {"ph": "X", "cat": "kernel", "name": "k0", "pid": 0, "tid": 7, "ts": 10.0, "dur": 100.0,
            "args": {"correlation": 1}},
           {"ph": "X", "cat": "cpu_op", "name": "aten::nonzero", "pid": 100, "tid": 1, "ts": 20.0, "dur": 95.0,
            "args": {}},
           {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "pid": 100, "tid": 1, "ts": 21.0,
            "dur": 92.0, "args": {}},
           {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 100, "tid": 1, "ts": 300.0, "dur": 1.0,
            "args": {"correlation": 2}},
           {"ph": "X", "cat": "kernel", "name": "k1", "pid": 0, "tid": 7, "ts": 310.0, "dur": 100.0,
            "args": {"correlation": 2}}]
    a = KernelTraceAnalyzer({})
    for ev in evs:
        a.add(ev)
    places = a.summary()["host"]["gpu_idle"]["host_wait_by_place"]
    assert places["rows"][0] == {
        "part": "router", "label": "MoE router", "phase": "forward", "launched_under": None, "idle_ms": 0.2,
        "gaps": 1, "activities": 1, "mean_activity_us": 100.0, "mean_gap_us": 200.0, "longest_gap_us": 200.0,
        "after_blocking_ms": 0.2,
        "after_blocking_pct": 100.0, "kind": "after blocking calls"}
    assert places["after_blocking_by_op"] == {"aten::nonzero": 0.2}


class ChunkGatedDeltaRuleFunction(torch.autograd.Function):
    """fla 0.6.0's autograd Function by name and signature (what the profiler records of it), computing the gated
    delta rule with the fp32 reference of tests/fixtures/qwen3_5.py, so that it runs on the CPU."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first=False, cu_seqlens=None,
                cu_seqlens_cpu=None, chunk_indices=None, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, cp_context=None,
                chunk_size=64):
        ctx.save_for_backward(q, k, v, g, beta)
        return gated_delta_rule_reference(q, k, v, g, beta), None

    @staticmethod
    def backward(ctx, do, dht):
        with torch.enable_grad():
            xs = [x.detach().requires_grad_() for x in ctx.saved_tensors]
            grads = torch.autograd.grad(gated_delta_rule_reference(*xs), xs, do)
        return (*grads, *[None] * 15)


def test_gated_delta_rule_flops_forward_as_recorded_and_backward_through_its_flow(tmp_path):
    # ChunkGatedDeltaRuleFunction's args as recorded on an H200 (fla 0.6.0, tiny Qwen3.5: q/k/v [1, 256, 4, 16])
    h200 = {"Concrete Inputs": ["", "", "", "", "", "0.25", "", "False", "False", "", "", "", "False", "False", "", "",
                                "False", "False", "", "64"],
            "Input type": ["c10::BFloat16", "c10::BFloat16", "c10::BFloat16", "float", "c10::BFloat16", "Scalar", "",
                           "Scalar", "Scalar", "", "", "", "Scalar", "Scalar", "", "", "Scalar", "Scalar", "",
                           "Scalar"],
            "Input Dims": [[1, 256, 4, 16], [1, 256, 4, 16], [1, 256, 4, 16], [1, 256, 4], [1, 256, 4]] + [[]] * 15}
    # 4 chunks of 64 per head: 6 C dk dv + 6 C^2 dk + 4 C^2 dv + C^3 / 3 each
    per_chunk = 6 * 64 * 16 * 16 + 6 * 64 * 64 * 16 + 4 * 64 * 64 * 16 + 64 ** 3 / 3
    assert op_flops("ChunkGatedDeltaRuleFunction", h200) == ("linear attention", 4 * 4 * per_chunk, "BFloat16")
    varlen = dict(h200, **{"Input Dims": h200["Input Dims"][:9] + [[5]] + h200["Input Dims"][10:]})
    assert op_flops("ChunkGatedDeltaRuleFunction", varlen) is None  # chunks per sequence unknown
    # a real trace: the backward op records only dO, so it gets 2x the forward op its fwdbwd flow starts at
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.nn.functional.normalize(torch.randn(2, 80, 3, 8, generator=gen), dim=-1).requires_grad_()
            for _ in range(2))
    v = torch.randn(2, 80, 6, 8, generator=gen).requires_grad_()
    g, beta = -torch.rand(2, 80, 6, generator=gen), torch.rand(2, 80, 6, generator=gen)
    with torch.profiler.profile(record_shapes=True) as prof:
        o, _ = ChunkGatedDeltaRuleFunction.apply(q.repeat_interleave(2, 2), k.repeat_interleave(2, 2), v, g, beta,
                                                 8 ** -0.5, None, False, False, None, None, None, False, False, None,
                                                 None, False, False, None, 64)
        o.sum().backward()
    trace = tmp_path / "t.json"
    prof.export_chrome_trace(str(trace))
    collector = OpCollector()
    events = json.loads(trace.read_text())["traceEvents"]
    for ev in events:  # as KernelTraceAnalyzer feeds it: complete events and fwdbwd flows
        if ev.get("ph") == "X" or ev.get("cat") == "fwdbwd":
            collector.add(ev, ev.get("cat"), ev["ts"], ev.get("dur", 0.0))
    ops = {e["name"]: e for e in events if e.get("name", "").startswith("ChunkGatedDeltaRuleFunction")}
    names = ["ChunkGatedDeltaRuleFunction", "ChunkGatedDeltaRuleFunctionBackward"]
    idx = collector.flop_op_of(np.array([ops[n]["tid"] for n in names]),
                               np.array([ops[n]["ts"] + ops[n]["dur"] / 2 for n in names]))
    # b = 2, 6 value heads (q and k repeated to them), 80 tokens = 2 chunks of 64, d_k = d_v = 8
    fwd = 2 * 6 * 2 * (6 * 64 * 8 * 8 + 6 * 64 * 64 * 8 + 4 * 64 * 64 * 8 + 64 ** 3 / 3)
    assert [collector.flop_info(int(i)) for i in idx] == [
        ("ChunkGatedDeltaRuleFunction", "linear attention", fwd, "float"),
        ("ChunkGatedDeltaRuleFunctionBackward", "linear attention backward", 2 * fwd, "float")]
