// The tree-attention work item, written once against a vector type `V` of LANES fp32 lanes.
//
// Included by each ISA's translation unit inside its own namespace, after it defines `V`. Every
// computation is vectorised over query rows: Q is packed transposed and pre-scaled (Q^T [d][rows]),
// so scores S^T[key][rows] = sum_k K[key][k] * Q^T[k][rows] broadcast one key element at a time
// (K and V are read in place, any layout, through one pointer per key), softmax statistics are
// plain per-lane vectors, and O^T[dv][rows] += V[key][dv] * P^T[key][rows] the same way. Each KV
// tile is therefore loaded once for all T x group rows of its head, and no transpose of K or V
// is ever made.

// ------------------------------------------------------------------ scalar conversions
static inline float bits_to_float(uint32_t u) { float f; __builtin_memcpy(&f, &u, 4); return f; }
static inline uint32_t float_to_bits(float f) { uint32_t u; __builtin_memcpy(&u, &f, 4); return u; }

static inline float bf16_to_float(uint16_t b) { return bits_to_float(uint32_t(b) << 16); }

static inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch does
  const uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // NaN stays NaN
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (man << 13));  // inf / NaN
  if (exp != 0) return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
  const float sub = float(man) * (1.0f / 16777216.0f);  // subnormal: man * 2^-24
  return sign ? -sub : sub;
}

static inline uint16_t float_to_half(float f) {  // round to nearest even
  const uint32_t u = float_to_bits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u);  // NaN
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // overflows to inf (from 65520 up)
  if (a < 0x38800000u) {  // below the smallest normal half: subnormal or zero
    const float scaled = bits_to_float(a) * 16777216.0f;  // in units of 2^-24, exact
    uint32_t m = uint32_t(scaled);
    const float rest = scaled - float(m);
    if (rest > 0.5f || (rest == 0.5f && (m & 1u))) ++m;
    return uint16_t(sign | m);
  }
  const uint32_t r = a + 0x0fffu + ((a >> 13) & 1u) - 0x38000000u;  // rebias 127 -> 15, round
  return uint16_t(sign | (r >> 13));
}

static inline float load_one(const void* base, int32_t dtype, int64_t i) {
  if (dtype == F32) return static_cast<const float*>(base)[i];
  const uint16_t x = static_cast<const uint16_t*>(base)[i];
  return dtype == BF16 ? bf16_to_float(x) : half_to_float(x);
}

static inline void store_one(void* base, int32_t dtype, int64_t i, float x) {
  if (dtype == F32) static_cast<float*>(base)[i] = x;
  else static_cast<uint16_t*>(base)[i] = dtype == BF16 ? float_to_bf16(x) : float_to_half(x);
}

static inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

// ------------------------------------------------------------------ micro-kernels
// S^T[i][r] for NB keys x RV vectors of rows: NB x RV accumulators, one broadcast key element each.
template <int NB, int RV>
static inline void qk_block(const float* const* kp, const float* qt, int64_t rp, int64_t d, float* s) {
  typename V::T acc[NB][RV];
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < RV; ++j) acc[i][j] = V::zero();
  for (int64_t k = 0; k < d; ++k) {
    typename V::T q[RV];
    for (int j = 0; j < RV; ++j) q[j] = V::load(qt + k * rp + j * LANES);
    for (int i = 0; i < NB; ++i) {
      const typename V::T b = V::bcast(kp[i] + k);
      for (int j = 0; j < RV; ++j) acc[i][j] = V::fma(b, q[j], acc[i][j]);
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < RV; ++j) V::store(s + i * rp + j * LANES, acc[i][j]);
}

// O^T[dv0 + i][r] = alpha[r] * O^T[dv0 + i][r] + sum_n V[n][dv0 + i] * P^T[n][r]. MASKED (tree tiles):
// a key a row cannot see is dropped with a bit mask, so a NaN/inf in it cannot reach the row
// (0 * NaN would).
template <int DB, int RV, bool MASKED>
static inline void pv_block(const float* const* vp, int64_t dv0, const float* p, const float* mask, int64_t rp,
                            int64_t count, const float* alpha, float* ot) {
  typename V::T acc[DB][RV];
  for (int j = 0; j < RV; ++j) {
    const typename V::T a = V::load(alpha + j * LANES);
    for (int i = 0; i < DB; ++i) acc[i][j] = V::mul(V::load(ot + (dv0 + i) * rp + j * LANES), a);
  }
  for (int64_t n = 0; n < count; ++n) {
    typename V::T pr[RV];
    for (int j = 0; j < RV; ++j) pr[j] = V::load(p + n * rp + j * LANES);
    for (int i = 0; i < DB; ++i) {
      const typename V::T b = V::bcast(vp[n] + dv0 + i);
      for (int j = 0; j < RV; ++j) {
        if (MASKED) acc[i][j] = V::add(acc[i][j], V::band(V::mul(b, pr[j]), V::load(mask + n * rp + j * LANES)));
        else acc[i][j] = V::fma(b, pr[j], acc[i][j]);
      }
    }
  }
  for (int j = 0; j < RV; ++j)
    for (int i = 0; i < DB; ++i) V::store(ot + (dv0 + i) * rp + j * LANES, acc[i][j]);
}

// Row vectors are taken 3 at a time (12 accumulators with 4 keys / dims), the rest as pairs; a
// single vector only when there is just one.
static inline int row_step(int64_t left) { return left == 1 ? 1 : (left == 2 || left == 4) ? 2 : 3; }

template <int NB>
static void qk_rows(const float* const* kp, const float* qt, int64_t rp, int64_t d, float* s) {
  for (int64_t r = 0; r < rp;) {
    const int step = row_step((rp - r) / LANES);
    if (step == 3) qk_block<NB, 3>(kp, qt + r, rp, d, s + r);
    else if (step == 2) qk_block<NB, 2>(kp, qt + r, rp, d, s + r);
    else qk_block<NB, 1>(kp, qt + r, rp, d, s + r);
    r += step * LANES;
  }
}

template <int DB, bool MASKED>
static void pv_rows(const float* const* vp, int64_t dv0, const float* p, const float* mask, int64_t rp,
                    int64_t count, const float* alpha, float* ot) {
  for (int64_t r = 0; r < rp;) {
    const int step = row_step((rp - r) / LANES);
    if (step == 3) pv_block<DB, 3, MASKED>(vp, dv0, p + r, mask + r, rp, count, alpha + r, ot + r);
    else if (step == 2) pv_block<DB, 2, MASKED>(vp, dv0, p + r, mask + r, rp, count, alpha + r, ot + r);
    else pv_block<DB, 1, MASKED>(vp, dv0, p + r, mask + r, rp, count, alpha + r, ot + r);
    r += step * LANES;
  }
}

template <bool MASKED>
static void pv_all(const float* const* vp, int64_t dv, const float* p, const float* mask, int64_t rp,
                   int64_t count, const float* alpha, float* ot) {
  int64_t c = 0;
  for (; c + 4 <= dv; c += 4) pv_rows<4, MASKED>(vp, c, p, mask, rp, count, alpha, ot);
  switch (dv - c) {
    case 3: pv_rows<3, MASKED>(vp, c, p, mask, rp, count, alpha, ot); break;
    case 2: pv_rows<2, MASKED>(vp, c, p, mask, rp, count, alpha, ot); break;
    case 1: pv_rows<1, MASKED>(vp, c, p, mask, rp, count, alpha, ot); break;
    default: break;
  }
}

// ------------------------------------------------------------------ the work item
// Element offset of key j (of request b, KV head h) in K or V.
static inline int64_t key_offset(const Problem& p, int64_t b, int64_t j, int64_t page, int64_t tok, int64_t head,
                                 int64_t h) {
  if (p.page_size == 0) return (p.kv_starts[b] + j) * tok + h * head;
  const int64_t id = p.page_indices[p.page_starts[b] + j / p.page_size];
  return id * page + (j % p.page_size) * tok + h * head;
}

// Pointers to `count` fp32 rows of K or V (in place for fp32, else widened into `buf`).
static void tile_rows(const Problem& p, const void* base, int64_t page, int64_t tok, int64_t head, int64_t width,
                      const Item& it, int64_t j0, int64_t count, float* buf, const float** rows) {
  for (int64_t i = 0; i < count; ++i) {
    const int64_t off = key_offset(p, it.b, j0 + i, page, tok, head, it.h);
    if (p.dtype == F32) {
      rows[i] = static_cast<const float*>(base) + off;
    } else {
      float* dst = buf + i * width;
      const uint16_t* src = static_cast<const uint16_t*>(base) + off;
      if (p.dtype == BF16) V::widen_bf16(src, dst, width);
      else V::widen_f16(src, dst, width);
      rows[i] = dst;
    }
  }
}

static void run_item(const Problem& p, const Item& it, float* scratch) {
  const int64_t d = p.d, dv = p.dv, group = p.group, b = it.b;
  const int64_t rows = (it.t1 - it.t0) * group, rp = padded_rows(rows), keys = KEY_TILE + KEY_PAD;
  const int64_t qo = p.qo_lens[b], kv = p.kv_lens[b], n = p.tree_sizes[b], tree_lo = kv - n;
  float* qt = scratch;
  float* s = qt + d * rp;
  float* mask = s + keys * rp;
  float* ot = mask + keys * rp;
  float* m = ot + dv * rp;
  float* l = m + rp;
  float* alpha = l + rp;
  int32_t* enter = reinterpret_cast<int32_t*>(alpha + rp);
  float* kbuf = alpha + 2 * rp;
  float* vbuf = kbuf + keys * d;
  float* zero_row = vbuf + keys * dv;
  const float* kp[KEY_TILE + KEY_PAD];
  const float* vp[KEY_TILE + KEY_PAD];

  // Q^T, pre-scaled; padding rows are zero and see no tree key (enter -1).
  for (int64_t r = 0; r < rp; ++r) {
    const int64_t t = it.t0 + r / group, g = r % group;
    if (r < rows) {
      const int64_t off = (p.q_starts[b] + t) * p.q_row + (it.h * group + g) * p.q_head;
      for (int64_t k = 0; k < d; ++k) qt[k * rp + r] = load_one(p.q, p.dtype, off + k) * p.scale2;
      enter[r] = n ? p.tree_order[2 * (p.tree_starts[b] + t + n - qo)] : -1;
    } else {
      for (int64_t k = 0; k < d; ++k) qt[k * rp + r] = 0.0f;
      enter[r] = -1;
    }
  }
  for (int64_t i = 0; i < (d > dv ? d : dv); ++i) zero_row[i] = 0.0f;
  for (int64_t r = 0; r < rp; r += LANES) {
    V::store(m + r, V::set1(-__builtin_inff()));
    V::store(l + r, V::zero());
  }
  for (int64_t i = 0; i < dv * rp; i += LANES) V::store(ot + i, V::zero());

  const int32_t* order = p.tree_order + 2 * p.tree_starts[b];
  for (int64_t j0 = it.c0; j0 < it.c1; j0 += KEY_TILE) {
    const int64_t count = imin(KEY_TILE, it.c1 - j0), padded = (count + KEY_PAD - 1) / KEY_PAD * KEY_PAD;
    tile_rows(p, p.k, p.k_page, p.k_tok, p.k_head, d, it, j0, count, kbuf, kp);
    tile_rows(p, p.v, p.v_page, p.v_tok, p.v_head, dv, it, j0, count, vbuf, vp);
    for (int64_t i = count; i < padded; ++i) kp[i] = zero_row;
    for (int64_t i = 0; i < padded; i += KEY_PAD) qk_rows<KEY_PAD>(kp + i, qt, rp, d, s + i * rp);

    // The ancestor test, only on tiles holding tree keys: key of node a is visible to row of node u
    // iff enter[a] <= enter[u] < exit[a]. Invisible scores are replaced (not offset) by -inf.
    const bool masked = n > 0 && j0 + count > tree_lo;
    for (int64_t r = 0; r < rp; r += LANES) {
      typename V::T top = V::set1(-__builtin_inff());
      for (int64_t i = 0; i < count; ++i) {
        typename V::T x = V::load(s + i * rp + r);
        if (masked) {
          const int64_t node = j0 + i - tree_lo;
          const typename V::T vis = node < 0 ? V::all_ones()
                                             : V::visible(enter + r, order[2 * node], order[2 * node + 1]);
          x = V::select(vis, x, V::set1(-__builtin_inff()));
          V::store(mask + i * rp + r, vis);
        }
        V::store(s + i * rp + r, x);
        top = V::max(top, x);
      }
      const typename V::T old = V::load(m + r), fresh = V::max(old, top);
      // A row that has seen no visible key yet keeps max -inf: subtract 0 instead (exp2(-inf) = 0).
      const typename V::T shift = V::select(V::eq(fresh, V::set1(-__builtin_inff())), V::zero(), fresh);
      const typename V::T a = V::exp2(V::sub(old, shift));
      typename V::T sum = V::zero();
      for (int64_t i = 0; i < count; ++i) {
        const typename V::T e = V::exp2(V::sub(V::load(s + i * rp + r), shift));
        V::store(s + i * rp + r, e);
        sum = V::add(sum, e);
      }
      V::store(l + r, V::fma(V::load(l + r), a, sum));
      V::store(m + r, fresh);
      V::store(alpha + r, a);
    }
    if (masked) pv_all<true>(vp, dv, s, mask, rp, count, alpha, ot);
    else pv_all<false>(vp, dv, s, mask, rp, count, alpha, ot);
  }

  // Normalise and write (transposing back to rows): the final output, or this chunk's partial result.
  for (int64_t r = 0; r < rows; ++r) {
    const float sum = l[r];
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    const float lse = sum > 0.0f ? __builtin_log2f(sum) + m[r] : EMPTY_LSE;
    if (it.part_o) {
      for (int64_t c = 0; c < dv; ++c) it.part_o[r * dv + c] = ot[c * rp + r] * inv;
      it.part_lse[r] = lse;
    } else {
      const int64_t t = p.q_starts[b] + it.t0 + r / group, head = it.h * group + r % group;
      const int64_t off = t * p.o_row + head * p.o_head;
      for (int64_t c = 0; c < dv; ++c) store_one(p.out, p.dtype, off + c, ot[c * rp + r] * inv);
      p.lse[t * p.l_row + head * p.l_head] = lse;
    }
  }
}
