"""benchmarks/step_trace.py: kernels and busy time per step from a profiler trace, and profile_step's step_trace part."""

import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.append(str(REPO / "benchmarks"))  # the benchmark scripts' helper modules

import profile_step  # noqa: E402
import step_trace  # noqa: E402


def metadata(pid, name, tid=None):
    event = dict(ph="M", pid=pid, name="process_name" if tid is None else "thread_name", args=dict(name=name))
    if tid is not None:
        event["tid"] = tid
    return event


def complete(pid, tid, name, ts, dur, **args):
    return dict(ph="X", pid=pid, tid=tid, name=name, ts=ts, dur=dur, args=args)


GPU, HOST = 1, 701
STREAM_A, STREAM_B, OVERHEAD, PYTHON = 7, 13, 99, 5
GPU_TRACE = {"displayTimeUnit": "ns", "metadata": {"highres-ticks": True}, "traceEvents": [
    metadata(GPU, "/device:GPU:0"), metadata(HOST, "/host:CPU"),
    metadata(GPU, "Stream #7(Kernel)", STREAM_A), metadata(GPU, "Stream #13(Kernel,MemcpyD2H)", STREAM_B),
    metadata(GPU, "CUPTI overhead", OVERHEAD), metadata(HOST, "python", PYTHON),
    # Stream 7: three kernels, two of them overlapped by stream 13's kernel [5, 15).
    complete(GPU, STREAM_A, "input_reduce_fusion_1", 0.0, 10.0, kernel_details="regs:32"),
    complete(GPU, STREAM_A, "gemm_fusion_dot_3", 12.0, 8.0),
    complete(GPU, STREAM_A, "loop_add_fusion", 30.0, 5.0),
    complete(GPU, STREAM_B, "input_reduce_fusion_2", 5.0, 10.0),
    complete(GPU, STREAM_B, "MemcpyD2H", 40.0, 2.0, memcpy_details="kind_src:device size:4"),
    complete(GPU, OVERHEAD, "overhead", 50.0, 10.0),
    dict(ph="C", pid=GPU, tid=0, name="power_mw", ts=1.0, args=dict(power_mw=1.0)),
    # Host: launches and host-side op annotations are not kernels.
    complete(HOST, PYTHON, "PjitFunction(run)", 0.0, 100.0),
    complete(HOST, PYTHON, "cuLaunchKernel", 1.0, 2.0, hlo_op="fusion.9"),
]}

CLIENT, EIGEN = 11, 12
CPU_TRACE = {"traceEvents": [
    metadata(HOST, "/host:CPU"), metadata(HOST, "python", PYTHON),
    metadata(HOST, "tf_XLAPjRtCpuClient/1", CLIENT), metadata(HOST, "tf_XLAEigen/2", EIGEN),
    complete(HOST, CLIENT, "while.5", 0.0, 3.0, hlo_op="while.5", hlo_module="jit_run"),
    complete(HOST, CLIENT, "copy.1", 1.0, 1.0, hlo_op="copy.1"),
    complete(HOST, CLIENT, "end: copy.1", 2.0, 0.2),
    complete(HOST, EIGEN, "fusion.2", 4.0, 4.0, hlo_op="fusion.2"),
    complete(HOST, EIGEN, "end: fusion.2", 8.0, 0.3),
    complete(HOST, EIGEN, "call.3", 10.0, 10.0, hlo_op="call.3"),  # encloses dot.4: a container
    complete(HOST, EIGEN, "dot.4", 11.0, 4.0, hlo_op="dot.4"),
    complete(HOST, CLIENT, "dot.7", 12.0, 4.0, hlo_op="dot.7"),  # overlaps dot.4 on another thread
    complete(HOST, PYTHON, "PjitFunction(run)", 0.0, 30.0),
]}


def test_gpu_kernels_are_stream_events_with_overlaps_merged():
    summary = step_trace.summarize(GPU_TRACE, num_steps=2)
    assert summary["trace_device"] == "gpu"
    assert summary["kernels_per_step"] == 2.0  # four kernels, two steps
    assert summary["busy_us_per_step"] == 12.5  # [0, 20) and [30, 35)
    assert summary["kernel_us_per_step"] == 16.5  # 10 + 8 + 5 + 10, overlaps counted twice
    assert summary["span_us_per_step"] == 17.5  # 0 to 35
    assert (summary["copies_per_step"], summary["copy_us_per_step"]) == (0.5, 1.0)
    assert summary["top_kernels"] == [
        dict(name="input_reduce_fusion_1", count_per_step=0.5, us_per_step=5.0, us_min=10.0, us_max=10.0),
        dict(name="input_reduce_fusion_2", count_per_step=0.5, us_per_step=5.0, us_min=10.0, us_max=10.0),
        dict(name="gemm_fusion_dot_3", count_per_step=0.5, us_per_step=4.0, us_min=8.0, us_max=8.0),
        dict(name="loop_add_fusion", count_per_step=0.5, us_per_step=2.5, us_min=5.0, us_max=5.0),
    ]
    assert summary["top_kinds"][0] == dict(name="input_reduce_fusion", count_per_step=1.0, us_per_step=10.0,
                                           us_min=10.0, us_max=10.0)
    assert len(step_trace.summarize(GPU_TRACE, num_steps=2, top=2)["top_kernels"]) == 2
    # A probe between the calls (kernels_bench's L2 eviction) is left out by name.
    probed = step_trace.summarize(GPU_TRACE, num_steps=2, exclude="input_reduce")
    assert (probed["kernels_per_step"], probed["busy_us_per_step"]) == (1.0, 6.5)  # [12, 20) and [30, 35)


def test_overlapping_kernels_on_one_stream_all_count():
    # CUPTI stamps consecutive kernels of one stream with overlapping intervals (the H200 trace
    # of 2026-11-30 did so for 95% of them); none of them encloses the next, so none is a container.
    events = [metadata(GPU, "/device:GPU:0"), metadata(GPU, "Stream #7(Kernel)", STREAM_A)]
    events += [complete(GPU, STREAM_A, f"fusion_{i}", 3.0 * i, 4.0) for i in range(5)]
    summary = step_trace.summarize({"traceEvents": events}, num_steps=1)
    assert summary["kernels_per_step"] == 5
    assert summary["busy_us_per_step"] == 16.0  # [0, 16): 4 + 3 * 4


def test_cpu_kernels_are_innermost_xla_op_events():
    device, kernels, copies = step_trace.kernel_events(CPU_TRACE)
    assert device == "cpu" and copies == []
    assert sorted(event.name for event in kernels) == ["copy.1", "dot.4", "dot.7", "fusion.2"]
    summary = step_trace.summarize(CPU_TRACE, num_steps=1)
    assert summary["kernels_per_step"] == 4
    assert summary["busy_us_per_step"] == 10.0  # 1 + 4 + [11, 16)
    assert summary["kernel_us_per_step"] == 13.0


def test_device_selection_is_explicit():
    # Forced to "cpu", a GPU trace yields its host-side op annotations, never its stream kernels.
    device, kernels, _ = step_trace.kernel_events(GPU_TRACE, device="cpu")
    assert device == "cpu" and [event.name for event in kernels] == ["cuLaunchKernel"]
    with pytest.raises(ValueError, match="no gpu kernel events"):
        step_trace.summarize(CPU_TRACE, num_steps=1, device="gpu")
    with pytest.raises(ValueError, match="device must be"):
        step_trace.kernel_events(CPU_TRACE, device="tpu")


def test_reads_the_newest_run(tmp_path):
    for run, trace in (("2026_01_01_00_00_00", CPU_TRACE), ("2026_01_01_00_00_01", GPU_TRACE)):
        (tmp_path / "plugins" / "profile" / run).mkdir(parents=True)
        with gzip.open(tmp_path / "plugins" / "profile" / run / "host.trace.json.gz", "wt") as file:
            json.dump(trace, file)
    path = step_trace.find_trace_file(tmp_path)
    assert path.parent.name == "2026_01_01_00_00_01"
    assert step_trace.kernel_events(step_trace.load_trace(path))[0] == "gpu"


@pytest.mark.parametrize("method,decode_kernels,tree,tiling", [
    ("none", "xla", None, None), ("eagle3", "xla", None, None), ("none", "pallas", None, "16/2/2/2"),
    ("eagle3", "xla", "2,2,3", None)])
def test_step_trace_part_on_cpu(method, decode_kernels, tree, tiling, random_target, random_head, tmp_path):
    target = random_target()
    head = random_head(target.config, "eagle3", draft_vocab_size=50) if method == "eagle3" else None
    args = profile_step.parse_args(["--parts", "step_trace", "--method", method, "--k", "2", "--batch-size", "2",
                                    "--trace-steps", "6", "--steps-per-call", "3", "--label", "before", "--top-kernels", "4",
                                    "--dtype", "float32", "--trace-dir", str(tmp_path),
                                    "--decode-kernels", decode_kernels] + (["--tree", tree] if tree else [])
                                   + (["--attention-tiling", tiling] if tiling else []))
    row = dict(profile_step.trace_part(args, target, head, [1, 5, 7, 9, 11], False), **profile_step.metadata(args))
    assert {"kind", "label", "method", "k", "batch_size", "kernels_per_step", "busy_us_per_step", "wall_us_per_step",
            "top_kernels", "command", "date", "device", "jax_version", "decode_kernels"} <= set(row)
    assert (row["kind"], row["label"], row["method"], row["batch_size"]) == ("step_trace", "before", method, 2)
    assert row["decode_kernels"] == decode_kernels
    assert row["attention_tiling"] == (tiling and tiling + "/16")  # query_rows: the default's
    assert row["k"] == (0 if method == "none" else 2)
    # A tree row names its shape (SGLang's settings); a chain's are None.
    shape = tuple(row[f"speculative_{name}"] for name in ("eagle_topk", "num_steps", "num_draft_tokens"))
    assert shape == (tuple(map(int, tree.split(","))) if tree else (None, None, None))
    assert (row["traced_steps"], row["calls"], row["trace_device"]) == (6, 2, "cpu")
    assert row["kernels_per_step"] > 10 and 0 < row["busy_us_per_step"] <= row["span_us_per_step"]
    assert len(row["top_kernels"]) == len(row["top_kinds"]) == 4 and row["top_kernels"][0]["us_per_step"] > 0
    assert all(0 <= kernel["us_min"] <= kernel["us_max"] > 0 for kernel in row["top_kernels"])
    assert Path(row["trace_file"]).is_file()
    json.dumps(row)  # a JSON row


def test_train_step_profile_on_cpu(random_target):
    import profile_train  # noqa: E402 (benchmarks/ is on sys.path above)
    from eagle_jax.train import trainer as train
    from eagle_jax.train import objective as train_objective

    target = random_target(seed=2, vocab_size=61, num_layers=4)  # EAGLE-3 reads layers (2, 2, 1)
    cfg = train.TrainConfig(method="eagle3", batch_size=2, draft_vocab_size=40,
                            objective=train_objective.Objective(num_steps=2))
    head = train.new_head(target.config, cfg, np.ones((61,), np.int64))
    row = profile_train.profile(train.Trainer(target, head, cfg), 61, batch_size=2, length=16, timed_steps=1,
                                traced_steps=2)
    assert row["step_ms"] > 0 and row["trained_tokens_per_second"] > 0
    assert row["trace_device"] == "cpu" and row["kernels_per_step"] > 10 and row["busy_us_per_step"] > 0
    assert any("dot" in kind["name"] or "fusion" in kind["name"] for kind in row["top_kinds"])


def test_random_target_from_a_config_needs_no_weights(tmp_path):
    # --random-target times a model of the config's shapes without downloading weights or a tokenizer.
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=32, intermediate_size=64,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=97,
                  rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "rows.json"
    code = profile_step.main(["--parts", "step_trace", "--random-target", str(tmp_path / "config.json"),
                              "--random-prompt-length", "7", "--method", "eagle3", "--k", "2", "--trace-steps", "2",
                              "--steps-per-call", "2", "--dtype", "float32", "--out", str(out)])
    [row] = json.loads(out.read_text())
    assert code == 0 and row["random_head"] and row["method"] == "eagle3" and row["kernels_per_step"] > 10
    assert row["prompt_length"] == 7


def test_by_module_splits_device_time_by_program():
    events = [metadata(GPU, "/device:GPU:0"), metadata(GPU, "Stream #7(Kernel)", STREAM_A),
              metadata(GPU, "Stream #13(Kernel)", STREAM_B),
              complete(GPU, STREAM_A, "fusion_1", 0.0, 10.0, hlo_module="jit__run"),
              complete(GPU, STREAM_B, "fusion_2", 5.0, 10.0, hlo_module="jit__run"),  # overlaps fusion_1
              complete(GPU, STREAM_A, "gemm_3", 40.0, 4.0, hlo_module="jit__start_rows"),
              complete(GPU, STREAM_A, "copy_4", 50.0, 1.0)]  # no module recorded
    summary = step_trace.by_module({"traceEvents": events})
    assert summary["trace_device"] == "gpu" and summary["busy_us"] == 20.0 and summary["span_us"] == 51.0
    assert summary["modules"] == [dict(module="jit__run", kernels=2, busy_us=15.0),
                                  dict(module="jit__start_rows", kernels=1, busy_us=4.0),
                                  dict(module="(unnamed)", kernels=1, busy_us=1.0)]
    with pytest.raises(ValueError, match="no gpu kernel events"):
        step_trace.by_module({"traceEvents": events[:3]}, device="gpu")


@pytest.mark.parametrize("argv,message", [
    (["--decode-kernels", "pallas", "--attention-tiling", "128/4/3"], "block_s/num_warps/num_stages/splits"),
    (["--decode-kernels", "pallas", "--attention-tiling", "128/four/3/1"], "integers"),
    (["--decode-kernels", "pallas", "--attention-tiling", "100/4/3/1"], "block_s must be a power of two"),
    (["--decode-kernels", "xla", "--parts", "step_trace", "--attention-tiling", "128/4/3/1"], "takes --decode-kernels pallas"),
    (["--decode-kernels", "pallas", "--attention-tiling", "128/4/3/1"], "cold_warm"),
])
def test_a_bad_attention_tiling_is_one_error_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        profile_step.parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
