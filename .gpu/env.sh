# GPU machine setup: wheels from /root/stage into /tmp/site, default model path.
S=/root/stage
n=$(ls $S/*.whl 2>/dev/null | wc -l)
if [ ! -f /tmp/site/.n$n ]; then
  python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site $S/*.whl > /dev/null 2>&1
  touch /tmp/site/.n$n
fi
export PYTHONPATH=/tmp/site:$PWD
export SPECPCG_DEFAULT_MODEL=$S/SmolLM2-135M-Instruct.Q4_1.gguf
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
