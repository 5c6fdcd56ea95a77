# The llama3.1-70b 8k bf16 recipe on tpu7x-4x4x4 (AI-Hypercomputer/tpu-recipes,
# training/ironwood), as its run_recipe.sh runs MaxText. NOT a verbatim copy: no network here;
# assembled from the shipped space llama31_70b_8k_maxtext.yaml and the settings issue 48 names
# (sa_q_layout/sa_k_layout SEQ_MINOR, use_tokamax_splash, use_iota_embed). Replace with the
# published file when fetched.
export LIBTPU_INIT_ARGS="--xla_tpu_scoped_vmem_limit_kib=61440 --xla_tpu_bf16_emission_mode=NATIVE_EMISSION --xla_tpu_enable_sparse_core_collective_offload_all_reduce=true --xla_tpu_use_single_sparse_core_for_all_gather_offload=true"
export JAX_PLATFORMS="tpu,cpu"
export ENABLE_PJRT_COMPATIBILITY="true"

python3 -m MaxText.train MaxText/configs/base.yml \
  model_name=llama3.1-70b \
  per_device_batch_size=2 \
  max_target_length=8192 \
  ici_fsdp_parallelism=-1 \
  remat_policy=custom \
  decoder_layer_input=device \
  context=device \
  query_proj=device \
  key_proj=device \
  value_proj=device \
  qkv_proj=device \
  attention=flash \
  use_tokamax_splash=True \
  sa_block_q=2048 \
  sa_block_kv=2048 \
  sa_block_kv_compute=2048 \
  sa_block_q_dkv=2048 \
  sa_block_kv_dkv=2048 \
  sa_block_kv_dkv_compute=2048 \
  sa_q_layout=SEQ_MINOR \
  sa_k_layout=SEQ_MINOR \
  use_iota_embed=True \
  mu_dtype=bfloat16 \
  dataset_type=synthetic \
  enable_checkpointing=False \
  profiler=xplane \
  skip_first_n_steps_for_profiler=10 \
  profiler_steps=5 \
  steps=30 \
  base_output_directory=gs://my-bucket/llama31-70b \
  run_name=llama31-70b-8k-bf16
