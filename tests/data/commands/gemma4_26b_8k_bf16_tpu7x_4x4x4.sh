# A gemma4-26b (MoE) 8k bf16 MaxText command on tpu7x-4x4x4 in the form tpu-recipes'
# run_recipe.sh takes. NOT the published recipe (no network here): written for the importer's
# tests from MaxText 0.2.5's gemma4-26b config and the levers the guide names; replace with the
# published file when fetched.
export LIBTPU_INIT_ARGS="--xla_tpu_scoped_vmem_limit_kib=65536 --xla_tpu_enable_sparse_core_collective_offload_all_gather=true --xla_tpu_enable_sparse_core_collective_offload_reduce_scatter=true"
python3 -m maxtext.trainers.pre_train.train src/maxtext/configs/base.yml \
  model_name=gemma4-26b \
  per_device_batch_size=4 \
  max_target_length=8192 \
  ici_fsdp_parallelism=-1 \
  remat_policy=custom \
  decoder_layer_input=offload \
  attention=flash \
  sparse_matmul=True \
  megablox=False \
  use_tokamax_gmm=True \
  fsdp_shard_on_exp=True \
  dataset_type=synthetic \
  enable_checkpointing=False \
  steps=20
