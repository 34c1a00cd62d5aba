#!/usr/bin/env bash
# Writes a hand-written facebook/opt-125m config.json (no weights) into an offline Hugging Face
# cache layout under HF_HOME_DIR (idempotent). vLLM's ModelConfig reads the model's config even
# when no weights are loaded; the integration tests run with HF_HOME pointing there and
# HF_HUB_OFFLINE=1.
#
# Usage: scripts/offline_hf_config.sh HF_HOME_DIR
set -euo pipefail
HF_HOME_DIR="${1:?usage: offline_hf_config.sh HF_HOME_DIR}"
log() { echo "[offline-hf-config] $*" >&2; }
SNAPSHOT="$HF_HOME_DIR/hub/models--facebook--opt-125m/snapshots/jaxkv-offline"
if [[ ! -f "$SNAPSHOT/config.json" ]]; then
  log "writing the offline facebook/opt-125m config"
  mkdir -p "$SNAPSHOT" "$HF_HOME_DIR/hub/models--facebook--opt-125m/refs"
  printf 'jaxkv-offline' > "$HF_HOME_DIR/hub/models--facebook--opt-125m/refs/main"
  cat > "$SNAPSHOT/config.json.tmp" <<'JSON'
{
  "_name_or_path": "facebook/opt-125m",
  "activation_dropout": 0.0,
  "activation_function": "relu",
  "architectures": ["OPTForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 2,
  "do_layer_norm_before": true,
  "dropout": 0.1,
  "enable_bias": true,
  "eos_token_id": 2,
  "ffn_dim": 3072,
  "hidden_size": 768,
  "init_std": 0.02,
  "layer_norm_elementwise_affine": true,
  "layerdrop": 0.0,
  "max_position_embeddings": 2048,
  "model_type": "opt",
  "num_attention_heads": 12,
  "num_hidden_layers": 12,
  "pad_token_id": 1,
  "prefix": "</s>",
  "torch_dtype": "float16",
  "transformers_version": "4.21.0.dev0",
  "use_cache": true,
  "vocab_size": 50272,
  "word_embed_proj_dim": 768
}
JSON
  mv "$SNAPSHOT/config.json.tmp" "$SNAPSHOT/config.json"
fi
