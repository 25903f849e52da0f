# Sourced by run_demo.sh and run_compare.sh (generated from the .sh.in files next to this one).
# gpu_count: prints how many NVIDIA GPUs `nvidia-smi -L` lists; 0 without nvidia-smi, without a
# driver, or when it fails.
gpu_count() {
  local listing
  listing=$(nvidia-smi -L 2>/dev/null) || { echo 0; return; }
  # grep -c prints 0 and exits 1 when nothing matches.
  grep -c '^GPU [0-9]' <<<"$listing" || true
}
