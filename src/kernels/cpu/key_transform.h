// Applies a layer's prepared key transform (core/key_transform.h) with the CPU
// rotation kernel: the one place where keys and queries enter the rotated basis,
// used by the host page store (backend/host_page_store.cpp) and by the
// evaluation's prefill simulation, so both store and score the same rows.
#pragma once

#include <cstdint>

#include "core/key_transform.h"

namespace oscar::kernels::cpu {

// k [n][Hkv][d] -> (k − μ[h])·M_K[h], in place.
void transform_keys(const KeyTransform& t, float* k, int64_t n, int Hkv);
// q [n][Hq][d] -> q·M_Q[g / (Hq / Hkv)], in place. Throws when Hq % Hkv != 0.
void transform_queries(const KeyTransform& t, float* q, int64_t n, int Hq, int Hkv);

}  // namespace oscar::kernels::cpu
