// Model loading: one entry point for GGUF files and Hugging Face directories.
// Both fill the same ModelWeights (fp32, HF layout and rotate-half RoPE; see
// model/config.h) and check every tensor's shape against the config.
#pragma once

#include <string>

#include "model/weights.h"

namespace oscar::model {

// `path` is a .gguf file, or a directory with config.json and model.safetensors
// (or model.safetensors.index.json + shards). Throws oscar::Error naming the
// file and the problem for anything malformed or unsupported.
ModelWeights load_model(const std::string& path);

ModelWeights load_gguf(const std::string& path);
ModelWeights load_hf(const std::string& dir);

// Throws oscar::Error (naming `source` and the tensor) when a weight is missing
// or its shape disagrees with w.cfg.
void check_weights(const ModelWeights& w, const std::string& source);

// Refuses (oscar::Error naming `source`, the bytes needed and those available) a
// model whose fp32 weights — what both loaders hold after dequantization — exceed
// the host memory this process may still take (core/host_memory.h). Called by
// the loaders once the config is known, before any tensor is read.
void check_host_memory(const ModelConfig& c, const std::string& source);
// Bytes of the fp32 weights of a model of config `c` (embedding, LM head unless tied, layers).
uint64_t fp32_weight_bytes(const ModelConfig& c);

// 32 hex digits: FNV-1a (two 64-bit lanes) over the architecture and sizes,
// then for every tensor in a fixed order its name, shape and up to 4096 evenly
// spaced fp32 values. Stable for the same dequantized weights.
std::string weights_fingerprint(const ModelWeights& w);

const char* arch_name(Arch a);

}  // namespace oscar::model
