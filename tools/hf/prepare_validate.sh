#!/usr/bin/env bash
# Builds, on a machine without a GPU, every training binary that tools/hf/validate_hf.py runs
# on the GPU machine (which has CUDA, PyTorch, transformers and safetensors, but no compiler
# front-end tools or LLVM to build fp8c with), into one folder to carry there:
#
#   OUT/configs/{gpt2,llama}/config.json the models' Hugging Face configs: GPT-2 124M as published
#                                        (vocabulary 50257), and a small Llama with grouped-query
#                                        attention (4 layers, dim 512, 8 heads, 2 key-value heads,
#                                        SwiGLU 1408, vocabulary 32000, untied head)
#   OUT/bin/{gpt2,llama}_{train,gen}_O{0,1,3}
#                                        built from those configs (fp8c build --config); train:
#                                        batch 8 x 128, gen: batch 1 x 32
#   OUT/manifest.json                    each binary's model, level, batch, sequence and config:
#                                        validate_hf.py makes the transformers models from the same
#                                        config.json files
#   OUT/data/sample.txt                  the text both sides read (as byte-valued token ids)
#
# The train binaries start from the Hugging Face models (--init), evaluate at step 0 (--eval-only),
# fine-tune and export (--export-hf); the gen binaries (--generate --logits) run the forward on the
# host, where batch 1 x 32 keeps a token of GPT-2 124M to a fraction of a second.
#
# usage: tools/hf/prepare_validate.sh [BUILD [OUT]]       (defaults: build, hf-validate)
#        SMALL=1 tools/hf/prepare_validate.sh ...          two-layer models, to try everything on
#                                                          a CPU in a minute
# Then carry OUT (ignored by git: name it in the device tool's `carry`) and run on the GPU machine:
#   python3 tools/hf/validate_hf.py --dir OUT --out "$OUT"
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build}
OUT=${2:-hf-validate}
JOBS=${JOBS:-2}

cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
make -C "$BUILD" -j"$JOBS" fp8c >/dev/null
FP8C=$BUILD/fp8c

# The models' configs, as Hugging Face config.json files: fp8c builds from them (--config) and
# validate_hf.py makes the transformers models from the same files.
if [ "${SMALL:-0}" = 1 ]; then
    GPT2_SIZE='"n_layer": 2, "n_embd": 128, "n_head": 4, "n_positions": 256'
    LLAMA_SIZE='"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 352'
    TRAIN_B=4 TRAIN_T=64
else   # GPT-2 124M as published; a small Llama
    GPT2_SIZE='"n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024'
    LLAMA_SIZE='"num_hidden_layers": 4, "hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 1408'
    TRAIN_B=8 TRAIN_T=128
fi
GEN_B=1 GEN_T=32

rm -rf "$OUT/bin" "$OUT/configs"
mkdir -p "$OUT/bin" "$OUT/data" "$OUT/configs/gpt2" "$OUT/configs/llama"
cat > "$OUT/configs/gpt2/config.json" <<JSON
{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 50257, $GPT2_SIZE,
 "activation_function": "gelu_new", "layer_norm_epsilon": 1e-05, "resid_pdrop": 0.0,
 "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 50256, "eos_token_id": 50256}
JSON
cat > "$OUT/configs/llama/config.json" <<JSON
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, $LLAMA_SIZE,
 "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-05,
 "tie_word_embeddings": false, "bos_token_id": 1, "eos_token_id": 2}
JSON
manifest="$OUT/manifest.json"
entries=()
for model in gpt2 llama; do
    for O in 0 1 3; do
        for kind in train gen; do
            B=$TRAIN_B T=$TRAIN_T
            [ $kind = gen ] && B=$GEN_B T=$GEN_T
            name=${model}_${kind}_O$O
            # shellcheck disable=SC2086
            "$FP8C" build models/$model.model -O$O --batch $B --seq $T \
                --config "$OUT/configs/$model/config.json" -o "$OUT/bin/$name" 2>&1 |
                grep -E "wrote|error" || true
            [ -x "$OUT/bin/$name" ] || { echo "prepare_validate: $name was not built" >&2; exit 1; }
            strip --strip-debug "$OUT/bin/$name"
            entries+=("  \"$name\": {\"model\": \"$model\", \"kind\": \"$kind\", \"level\": $O, \"batch\": $B, \"seq\": $T, \"config\": \"configs/$model\"}")
        done
    done
done
{
    echo "{"
    for i in "${!entries[@]}"; do
        sep=","
        [ "$i" -eq $((${#entries[@]} - 1)) ] && sep=""
        echo "${entries[$i]}$sep"
    done
    echo "}"
} > "$manifest"
cp data/gcide_sample.txt "$OUT/data/sample.txt"
echo "git commit: $(git rev-parse --short HEAD)$(git diff --quiet -- runtime compiler passes codegen cuda || echo ' (with local changes)')" > "$OUT/BUILD_INFO"
du -sh "$OUT"
echo "ready: carry $OUT, then run: python3 tools/hf/validate_hf.py --dir $OUT --out \"\$OUT\""
