# Sourced on the GPU machine from the repository root: packages copied there, provenance from the bare clone.
export PYTHONPATH=/tmp/site GIT_DIR=$PWD/.gpu/git GIT_WORK_TREE=$PWD OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1 \
  HF_HUB_OFFLINE=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
