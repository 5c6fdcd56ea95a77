# A gpt-oss-120b 8k MaxText run submitted with xpk on tpu7x-4x4x4, in the form tpu-recipes'
# xpk commands take. NOT the published recipe (no network here): written for the importer's
# tests from the settings issue 48 reports for the published one (fsdp_shard_on_exp, random
# routing with expert parallelism 1); replace with the published file when fetched. Its mesh
# is fsdp 64 x data 2: MaxText cannot shard gpt-oss's 2880-wide weights over fsdp 128 (the
# engine refuses that mesh by name; MaxText's compile of it had failed with JAX's
# IndivisibleError, tests/data/maxtext_0.2.5/indivisible.log).
xpk workload create --cluster my-cluster --workload gpt-oss-120b-8k \
  --tpu-type=tpu7x-128 --num-slices=1 --docker-image=gcr.io/my-project/maxtext:latest \
  --command "export LIBTPU_INIT_ARGS='--xla_tpu_scoped_vmem_limit_kib=61440 --xla_tpu_bf16_emission_mode=NATIVE_EMISSION' && \
  python3 -m MaxText.train MaxText/configs/base.yml model_name=gpt-oss-120b per_device_batch_size=2 \
  max_target_length=8192 ici_fsdp_parallelism=64 ici_data_parallelism=2 remat_policy=full attention=flash \
  sparse_matmul=True megablox=False use_tokamax_gmm=True fsdp_shard_on_exp=True \
  use_random_routing=True dataset_type=synthetic enable_checkpointing=False steps=20 \
  base_output_directory=gs://my-bucket/out run_name=gpt-oss-8k"
