# Decode-step levers on one H200: XLA programmatic-dependent-launch flags, the torch peer, MT-Bench, refills.
# Carried as .stage/queue.sh and started by tools/gpu/launch.sh start (tools/gpu/README.md).
cd /root/work
r=$RESULTS; d="--dataset /root/stage/mtbench_question.jsonl"
m="--num_prompts 80 --max_new_tokens 256 $d --out $r/mtbench.json"
# The default model's HF directory for the torch peer: setup.sh's export, else where eagle_jax converted it.
hf=${EAGLE_JAX_MODEL_DIR:-$(python3 -c "from eagle_jax.io import default_model; print(default_model.default_model_dir())")}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv | tee $r/device.txt
python3 -c "import jax, jaxlib, flax, torch; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__, 'torch', torch.__version__)" | tee -a $r/device.txt
echo "== kernel check"
python3 benchmarks/kernels_bench.py --check --rows 1,7,32 --tokens 1,7,32 --iterations 1 --trace-calls 1 \
  --out $r/kernels_check.json > $r/kernels_check.log 2>&1 && echo CHECK OK || echo CHECK FAILED
echo "== PDL flags in the XLA GPU plugin"
for so in $(find / -xdev \( -name "xla_cuda_plugin.so" -o -name "libjax_common.so" -o -name "xla_extension*.so" -o -name "_jax*.so" \) 2>/dev/null); do
  echo "$so"; strings "$so" | grep -oE 'xla_gpu[a-z0-9_]*(pdl|dependent|griddep|programmatic)[a-z0-9_]*' | sort -u
done | tee $r/pdl_flags.txt
flags=$(grep -E '^xla_gpu' $r/pdl_flags.txt | sort -u)
echo "== PTX of a plain step: griddepcontrol present?"
rm -rf /tmp/dump; XLA_FLAGS=--xla_dump_to=/tmp/dump timeout 200 python3 benchmarks/profile_step.py --parts step_trace --method none \
  --decode-kernels xla --trace-steps 8 --out /tmp/dump_profile.json > /dev/null 2>&1
echo "ptx files: $(ls /tmp/dump/*.ptx 2>/dev/null | wc -l), with griddepcontrol: $(grep -l griddepcontrol /tmp/dump/*.ptx 2>/dev/null | wc -l)" | tee -a $r/pdl_flags.txt
prof() { timeout 240 python3 benchmarks/profile_step.py --parts step_trace --decode-kernels pallas --trace-steps 64 --out $r/profile.json "$@" 2>&1 | grep -E "step_trace|us per step|kernels" | tail -3; }
echo "== step traces, default flags"
prof --method none --label "plain, default flags"
prof --method eagle3 --k 6 --label "eagle3 k=6, default flags"
for f in $flags; do
  echo "== step traces, --$f=true"
  XLA_FLAGS=--$f=true prof --method none --label "plain, --$f=true"
  XLA_FLAGS=--$f=true prof --method eagle3 --k 6 --label "eagle3 k=6, --$f=true"
done
echo "== torch peer (gpt-fast style, torch.compile reduce-overhead + CUDA graphs)"
timeout 420 python3 /root/stage/torch_step_peer.py --model $hf --prompts /root/stage/mtbench_question.jsonl --batch 1,16 --k 6 \
  --out $r/torch_peer.jsonl 2>&1 | grep -v Warning | tail -12
echo "== MT-Bench, batch 1, default flags"
timeout 300 python3 benchmarks/eagle.py --method none,eagle3 --num_spec_tokens 6 $m 2>&1 | grep -E "tok/s|tokens/s|acceptance" | tail -4
for f in $flags; do
  echo "== MT-Bench, batch 1, --$f=true"
  XLA_FLAGS=--$f=true timeout 300 python3 benchmarks/eagle.py --method none,eagle3 --num_spec_tokens 6 $m 2>&1 | grep -E "tok/s|tokens/s|acceptance" | tail -4
done
echo "== 16 rows continuous, refill_at"
for at in 1 4 16; do
  timeout 200 python3 benchmarks/eagle.py --method eagle3 --max_num_seqs 16 --refill_at $at --scheduler continuous --num_prompts 320 --max_new_tokens 256 $d --out $r/mtbench.json 2>&1 | grep -E "tok/s|tokens/s" | tail -2
done
echo BENCH DONE
