// kvcore::decode_stack: the decoder layers first_layer .. L - 1 of an int4a8 model (bfloat16 or float32) over rows that
// continue their caches (a decode batch, a speculative verification's rows) as one operator, instead of three
// operator calls and the Python between them per layer (kvcore/model/fused_layer.py). Each layer runs the same
// functions as the per-layer path, in its order, so the results are that path's bit for bit:
//   fused_qkv's body (fused_layer.h), then per call group cached_decode_attention's row writes and attention
//   (decode_attention.h), then fused_mlp's body.
//
// decode_stack(h, delta, first_layer, input_norms, post_norms, eps, qkv_packed, qkv_dm, o_packed, o_dm,
//              gate_up_packed, gate_up_dm, down_packed, down_dm, cos, sin, num_heads, k_cache, v_cache,
//              rows, seq_lens, first_slots, max_lens, scales, windows, softcaps) -> [T, d]
//   h [T, d]             hidden states (bfloat16 or float32: every tensor but the weights and indices of that
//                        dtype), updated in place; delta [T, d] what the first layer adds first
//   the weights, norms, cos / sin [T, 1, D] and scales, windows, softcaps: one entry per layer (L of each)
//   k_cache, v_cache     contiguous [L, S, H_kv, S_max, D]; written in place
//   call groups g        the tokens in order, as consecutive groups each taking one cached_decode_attention call:
//                        rows[g] int64 [L, T_g * H_kv], seq_lens[g] int32 [B_g] (T_g = B_g R_g tokens),
//                        first_slots[g], max_lens[g] (cached_decode_attention's arguments)
//   returns              the last layer's MLP output (the next norm adds it to h)
// Every argument is checked once, before the first layer; the loop then allocates nothing.

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "decode_attention.h"
#include "fused_layer.h"

namespace {

using BF16 = c10::BFloat16;

void check_list(size_t size, int64_t L, const char* what) {
  TORCH_CHECK(static_cast<int64_t>(size) == L, "decode_stack: ", what, " must have one entry per layer (", L, ")");
}

// The shape of one call, checked.
struct Stack {
  int64_t first_layer, L, T, H, H_kv, D, S, S_max, N;
  float eps;
};

template <typename E>
void run(const Stack& c, const std::vector<int64_t>& widths, at::Tensor& h, const std::optional<at::Tensor>& delta,
         at::TensorList input_norms, at::TensorList post_norms, at::TensorList qkv_packed, at::TensorList qkv_dm,
         at::TensorList o_packed, at::TensorList o_dm, at::TensorList gate_up_packed, at::TensorList gate_up_dm,
         at::TensorList down_packed, at::TensorList down_dm, at::TensorList cos, at::TensorList sin,
         at::Tensor& k_cache, at::Tensor& v_cache, at::TensorList rows, at::TensorList seq_lens,
         at::IntArrayRef first_slots, at::IntArrayRef max_lens, at::ArrayRef<double> scales, at::IntArrayRef windows,
         at::ArrayRef<double> softcaps, at::Tensor& out) {
  // scratch for the whole call: x, qkv, attn, then the MLP's o, x, gate/up and product
  const int64_t T = c.T, N = c.N, H_kv = c.H_kv, D = c.D;
  const int64_t d = h.size(1), A = c.H * D, I = *std::max_element(widths.begin() + c.first_layer, widths.end());
  std::unique_ptr<E[]> scratch(new E[T * (d + N + A + 2 * d + 3 * I)]);
  E *x = scratch.get(), *qkv = x + T * d, *attn = qkv + T * N;
  const kvcore_fused::MlpScratch<E> mlp{attn + T * A, attn + T * A + T * d, attn + T * A + 2 * T * d,
                                        attn + T * A + 2 * T * d + 2 * T * I};
  E *hp = h.data_ptr<E>(), *pending = out.data_ptr<E>();
  E *kc = k_cache.data_ptr<E>(), *vc = v_cache.data_ptr<E>();
  for (int64_t i = c.first_layer; i < c.L; ++i) {
    const E* add = i == c.first_layer ? (delta.has_value() ? delta->data_ptr<E>() : nullptr) : pending;
    kvcore_fused::qkv(hp, add, input_norms[i].data_ptr<E>(), T, d, c.eps, qkv_packed[i], qkv_dm[i],
                      cos[i].data_ptr<E>(), sin[i].data_ptr<E>(), D, c.H + H_kv, x, qkv);
    int64_t t0 = 0;
    for (size_t g = 0; g < rows.size(); ++g) {  // q, k, v: the heads of each qkv row, as the per-layer path views them
      const int64_t B = seq_lens[g].size(0), R = rows[g].size(1) / H_kv / B;
      const E* q = qkv + t0 * N;
      const kvcore_attn::CachedCall<E> call{q, q + A, q + A + H_kv * D, N, N, B, R, c.H, H_kv, D,
                                            rows[g].data_ptr<int64_t>() + i * rows[g].stride(0),
                                            seq_lens[g].data_ptr<int32_t>(), kc, vc,
                                            (i * c.S + first_slots[g]) * H_kv * c.S_max * D, c.S_max, max_lens[g],
                                            static_cast<float>(scales[i]), windows[i], static_cast<float>(softcaps[i]),
                                            attn + t0 * A};
      kvcore_attn::cached_attention(call);
      t0 += B * R;
    }
    kvcore_fused::mlp(hp, attn, T, d, A, widths[i], o_packed[i], o_dm[i], post_norms[i].data_ptr<E>(), c.eps,
                      gate_up_packed[i], gate_up_dm[i], down_packed[i], down_dm[i], mlp, pending);
  }
}

at::Tensor decode_stack(at::Tensor h, const std::optional<at::Tensor>& delta, int64_t first_layer,
                        at::TensorList input_norms, at::TensorList post_norms, double eps, at::TensorList qkv_packed,
                        at::TensorList qkv_dm, at::TensorList o_packed, at::TensorList o_dm,
                        at::TensorList gate_up_packed, at::TensorList gate_up_dm, at::TensorList down_packed,
                        at::TensorList down_dm, at::TensorList cos, at::TensorList sin, int64_t num_heads,
                        at::Tensor k_cache, at::Tensor v_cache, at::TensorList rows, at::TensorList seq_lens,
                        at::IntArrayRef first_slots, at::IntArrayRef max_lens, at::ArrayRef<double> scales,
                        at::IntArrayRef windows, at::ArrayRef<double> softcaps) {
  const int64_t L = static_cast<int64_t>(input_norms.size());
  TORCH_CHECK(first_layer >= 0 && first_layer < L, "decode_stack: first_layer must be 0..", L - 1);
  const std::pair<size_t, const char*> lists[] = {
      {post_norms.size(), "post_norms"}, {qkv_packed.size(), "qkv_packed"}, {qkv_dm.size(), "qkv_dm"},
      {o_packed.size(), "o_packed"}, {o_dm.size(), "o_dm"}, {gate_up_packed.size(), "gate_up_packed"},
      {gate_up_dm.size(), "gate_up_dm"}, {down_packed.size(), "down_packed"}, {down_dm.size(), "down_dm"},
      {cos.size(), "cos"}, {sin.size(), "sin"}, {scales.size(), "scales"}, {windows.size(), "windows"},
      {softcaps.size(), "softcaps"}};
  for (const auto& [size, what] : lists) check_list(size, L, what);
  TORCH_CHECK(k_cache.scalar_type() == h.scalar_type() && k_cache.dim() == 5 && k_cache.is_contiguous() &&
              v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == h.scalar_type() &&
              v_cache.is_contiguous() && k_cache.size(0) == L,
              "decode_stack: the caches must be contiguous [L, S, H_kv, S_max, D] of h's dtype");
  const int64_t S = k_cache.size(1), H_kv = k_cache.size(2), S_max = k_cache.size(3), D = k_cache.size(4);
  const int64_t H = num_heads, N = (H + 2 * H_kv) * D;
  kvcore_attn::check_shape(1, H, H_kv, D);

  // layers: what fused_qkv and fused_mlp check, for every layer
  std::vector<int64_t> widths(L);  // each layer's gate width I
  for (int64_t i = first_layer; i < L; ++i) {
    const int64_t n = kvcore_fused::check_qkv(h, i == first_layer ? delta : std::nullopt, input_norms[i],
                                              qkv_packed[i], qkv_dm[i], cos[i], sin[i], H + H_kv, "decode_stack");
    TORCH_CHECK(n == N && cos[i].size(-1) == D, "decode_stack: layer ", i, "'s Q/K/V must be ", H, " + 2 x ", H_kv,
                " heads of the cache's head size ", D);
    widths[i] = kvcore_fused::check_mlp(h, H * D, o_packed[i], o_dm[i], post_norms[i], gate_up_packed[i],
                                        gate_up_dm[i], down_packed[i], down_dm[i], "decode_stack");
    TORCH_CHECK(windows[i] >= 0 && softcaps[i] >= 0, "decode_stack: window and softcap must be >= 0 (0: none)");
  }

  // call groups: cached_decode_attention's checks, every layer's rows included
  const int64_t T = h.size(0), num_groups = static_cast<int64_t>(rows.size()), cache_rows = k_cache.numel() / D;
  TORCH_CHECK(num_groups >= 1 && seq_lens.size() == rows.size() && first_slots.size() == rows.size() &&
              max_lens.size() == rows.size(), "decode_stack: rows, seq_lens, first_slots and max_lens must have one "
              "entry per call group");
  int64_t tokens = 0;
  for (int64_t g = 0; g < num_groups; ++g) {
    const at::Tensor &r = rows[g], &lens = seq_lens[g];
    TORCH_CHECK(r.scalar_type() == at::kLong && r.dim() == 2 && r.size(0) == L && r.stride(1) == 1 &&
                r.size(1) % H_kv == 0, "decode_stack: rows must be int64 [L, T_g * H_kv] with contiguous rows");
    TORCH_CHECK(lens.scalar_type() == at::kInt && lens.dim() == 1 && lens.is_contiguous() && lens.size(0) >= 1 &&
                (r.size(1) / H_kv) % lens.size(0) == 0,
                "decode_stack: seq_lens must be int32 [B_g], the same number of tokens per sequence");
    const int64_t B = lens.size(0), R = r.size(1) / H_kv / B;
    kvcore_attn::check_shape(R, H, H_kv, D);
    TORCH_CHECK(first_slots[g] >= 0 && first_slots[g] + B <= S && max_lens[g] >= 1 && max_lens[g] <= S_max,
                "decode_stack: slots or max_len out of range");
    const int32_t* lp = lens.data_ptr<int32_t>();
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(lp[b] >= R && lp[b] <= max_lens[g], "decode_stack: seq_lens out of range ", R, "..", max_lens[g]);
    for (int64_t i = first_layer; i < L; ++i) {
      const int64_t* rp = r.data_ptr<int64_t>() + i * r.stride(0);
      for (int64_t j = 0; j < r.size(1); ++j)
        TORCH_CHECK(rp[j] >= 0 && rp[j] < cache_rows, "decode_stack: row ", rp[j], " out of range 0..",
                    cache_rows - 1);
    }
    tokens += B * R;
  }
  TORCH_CHECK(tokens == T, "decode_stack: the call groups must hold h's ", T, " tokens, not ", tokens);

  at::Tensor out = at::empty({T, h.size(1)}, h.options());
  const Stack stack{first_layer, L, T, H, H_kv, D, S, S_max, N, static_cast<float>(eps)};
  if (h.scalar_type() == at::kFloat)
    run<float>(stack, widths, h, delta, input_norms, post_norms, qkv_packed, qkv_dm, o_packed, o_dm, gate_up_packed,
               gate_up_dm, down_packed, down_dm, cos, sin, k_cache, v_cache, rows, seq_lens, first_slots, max_lens,
               scales, windows, softcaps, out);
  else
    run<BF16>(stack, widths, h, delta, input_norms, post_norms, qkv_packed, qkv_dm, o_packed, o_dm, gate_up_packed,
              gate_up_dm, down_packed, down_dm, cos, sin, k_cache, v_cache, rows, seq_lens, first_slots, max_lens,
              scales, windows, softcaps, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvcore, m) {
  m.def("decode_stack(Tensor(a!) h, Tensor? delta, int first_layer, Tensor[] input_norms, Tensor[] post_norms, "
        "float eps, Tensor[] qkv_packed, Tensor[] qkv_dm, Tensor[] o_packed, Tensor[] o_dm, Tensor[] gate_up_packed, "
        "Tensor[] gate_up_dm, Tensor[] down_packed, Tensor[] down_dm, Tensor[] cos, Tensor[] sin, int num_heads, "
        "Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor[] rows, Tensor[] seq_lens, int[] first_slots, "
        "int[] max_lens, float[] scales, int[] windows, float[] softcaps) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvcore, CPU, m) { m.impl("decode_stack", &decode_stack); }
