// GPU-less test of the CUDA back end: built with ASHL_CUDA_EMULATE, every launch
// runs serially on the host over host memory (ops, block mapping, tails,
// misaligned views, batching across launches, flags, validation). The CPU back
// end is linked in too, and both drivers of ashl/ops.h must give the same bits.
// Not part of the library build; tests/unit/test_cuda_emulation.py builds and runs
// it. By hand, from the repository root:
//   nvcc -std=c++17 -O2 -diag-suppress 20011 -Xcompiler -ffp-contract=off \
//        -Icsrc/include -Icsrc/cuda tests/native/cuda_emulate_test.cu csrc/common.cpp \
//        csrc/cpu/kernels.cpp csrc/cpu/halves.cpp -o /tmp/emulate_test && /tmp/emulate_test
#define ASHL_CUDA_EMULATE 1
#include "kernels.cu"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>

using namespace ashl;
using namespace ashl::cuda::detail;

static int failures = 0;
#define EXPECT(c) do { if (!(c)) { ++failures; std::printf("FAIL %s:%d: %s\n", __FILE__, __LINE__, #c); } } while (0)

template <class T> DType dt();
template <> DType dt<float>() { return DType::kFloat32; }
template <> DType dt<__half>() { return DType::kFloat16; }
template <> DType dt<__nv_bfloat16>() { return DType::kBFloat16; }

std::mt19937 rng(1234);
float rnd() { return std::uniform_real_distribution<float>(-2.f, 2.f)(rng); }

// ---------- 1. coverage of plan + block_span ----------
struct CountOp {
  static constexpr int kVec = 4;
  mutable int64_t vec_calls = 0;
  ASHL_HD bool skip() const { return false; }
  template <int V> void apply(void* const* p, int64_t i) const {
    int32_t* c = static_cast<int32_t*>(p[0]) + i;
    if (V > 1 && reinterpret_cast<uintptr_t>(c) % 16 != 0) std::abort();
    if (V > 1) ++vec_calls;
    for (int j = 0; j < V; ++j) ++c[j];
    // role 1 only checks alignment (points into the same buffer, shifted)
  }
};

template <int N>
void coverage(const std::vector<int64_t>& sizes, int misalign_every, bool second_role_misaligned) {
  int64_t total = 0;
  for (auto n : sizes) total += n;
  std::vector<int32_t> buf(total + 8 * sizes.size() + 16, 0);
  Work<N> w(sizes);
  std::vector<int32_t*> starts;
  int32_t* base = buf.data();
  while (reinterpret_cast<uintptr_t>(base) % 16) ++base;
  int64_t pos = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (misalign_every && i % misalign_every == 0) pos += 1;
    else pos = (pos + 3) / 4 * 4;
    starts.push_back(base + pos);
    for (int r = 0; r < N; ++r) w.ptrs[i][r] = base + pos + ((r == 1 && second_role_misaligned) ? 1 : 0);
    pos += sizes[i];
  }
  for (int r = 0; r < N; ++r) w.esize[r] = 4;
  CountOp op;
  int launches = 0;
  plan(w, CountOp::kVec, [&](const Meta<N>& m, int nb) {
    ++launches;
    EXPECT(nb >= 1 && nb <= kBlocks);
    for (int b = 0; b < nb; ++b) {
      EXPECT(m.tensor[b] < Meta<N>::kTensors);
      const Span s = block_span(m, b, CountOp::kVec);
      EXPECT(s.len > 0 && s.len <= kChunk && s.vec_len % 4 == 0 && s.vec_len <= s.len);
      // aligned bit must match the real pointers
      bool al = true;
      for (int r = 0; r < N; ++r) al = al && reinterpret_cast<uintptr_t>(m.ptr[r][s.tensor]) % 16 == 0;
      EXPECT(((m.aligned >> s.tensor) & 1u) == (al ? 1u : 0u));
    }
    launch(nb, kThreads, nullptr, MtaBody<N, CountOp>{m, op}, "count");
  });
  bool ok = true;
  for (size_t i = 0; i < sizes.size(); ++i)
    for (int64_t j = 0; j < sizes[i]; ++j) ok = ok && starts[i][j] == 1;
  int64_t ones = 0;
  for (auto x : buf) { ok = ok && (x == 0 || x == 1); ones += x; }
  EXPECT(ok);
  EXPECT(ones == total);
  std::printf("coverage N=%d tensors=%zu total=%lld launches=%d\n", N, sizes.size(), (long long)total, launches);
}

// ---------- helpers for typed lists ----------
template <class T>
struct Store {  // a buffer with tensors at chosen (possibly odd) element offsets
  std::vector<T> buf;
  TensorList list;
  Store(const std::vector<int64_t>& sizes, bool misalign) {
    int64_t total = 0;
    for (auto n : sizes) total += n + 9;
    buf.resize(total + 16);
    for (auto& x : buf) x = from_f<T>(rnd());
    list.dtype = dt<T>();
    int64_t pos = 0;
    while (reinterpret_cast<uintptr_t>(buf.data() + pos) % 16) ++pos;
    for (size_t i = 0; i < sizes.size(); ++i) {
      int64_t p = pos + ((misalign && i % 2 == 1) ? 1 : 0);
      list.ptrs.push_back(buf.data() + p);
      list.numels.push_back(sizes[i]);
      pos = p + sizes[i] + 8;
      pos = (pos + 7) / 8 * 8;
    }
  }
  T* at(size_t i) { return static_cast<T*>(list.ptrs[i]); }
};

template <class T> bool same_bits(T a, T b) { return std::memcmp(&a, &b, sizeof(T)) == 0; }

const std::vector<int64_t> kSizes = {0, 1, 7, 4, 65536, 65537, 131071, 3, 0, 200000, 13};

std::vector<int64_t> make_offsets(const std::vector<int64_t>& sizes, int64_t& flat_n, bool odd) {
  std::vector<int64_t> off;
  int64_t pos = odd ? 1 : 0;
  for (auto n : sizes) { off.push_back(pos); pos += n + (odd ? 3 : 0); }
  flat_n = pos + 2;
  return off;
}

template <class P, class F>
void test_pack_unpack(bool misalign, bool odd, bool with_res) {
  Store<P> prm(kSizes, misalign), anc(kSizes, misalign), res(kSizes, !misalign);
  int64_t fn;
  auto off = make_offsets(kSizes, fn, odd);
  std::vector<F> flat(fn, from_f<F>(777.f));
  Flat out{flat.data(), dt<F>(), fn};
  const float scale = 0.37f;
  cuda::pack_delta(prm.list, anc.list, with_res ? &res.list : nullptr, off, out, scale, CudaContext{});
  bool ok = true;
  std::vector<char> covered(fn, 0);
  for (size_t i = 0; i < kSizes.size(); ++i)
    for (int64_t j = 0; j < kSizes[i]; ++j) {
      float e = scale * (to_f(prm.at(i)[j]) - to_f(anc.at(i)[j]));
      if (with_res) e += to_f(res.at(i)[j]);
      ok = ok && same_bits(flat[off[i] + j], from_f<F>(e));
      covered[off[i] + j] = 1;
    }
  for (int64_t k = 0; k < fn; ++k) if (!covered[k]) ok = ok && to_f(flat[k]) == to_f(from_f<F>(777.f));
  EXPECT(ok);
  // unpack_add: anchors += flat; params = anchors
  std::vector<P> a0(anc.buf);
  cuda::unpack_add(prm.list, anc.list, off, out, CudaContext{});
  ok = true;
  for (size_t i = 0; i < kSizes.size(); ++i) {
    const int64_t shift = anc.at(i) - anc.buf.data();
    for (int64_t j = 0; j < kSizes[i]; ++j) {
      P e = from_f<P>(to_f(a0[shift + j]) + to_f(flat[off[i] + j]));
      ok = ok && same_bits(anc.at(i)[j], e) && same_bits(prm.at(i)[j], e);
    }
  }
  EXPECT(ok);
  // unpack_assign
  for (auto& x : flat) x = from_f<F>(rnd());
  cuda::unpack_assign(prm.list, anc.list, off, out, CudaContext{});
  ok = true;
  for (size_t i = 0; i < kSizes.size(); ++i)
    for (int64_t j = 0; j < kSizes[i]; ++j) {
      P e = from_f<P>(to_f(flat[off[i] + j]));
      ok = ok && same_bits(anc.at(i)[j], e) && same_bits(prm.at(i)[j], e);
    }
  EXPECT(ok);
}

template <class D, class X>
void test_merge_dense(bool misalign) {
  Store<D> dst(kSizes, misalign);
  Store<X> del(kSizes, !misalign);
  int32_t scratch[4] = {5, 5, 5, 5};
  CudaContext ctx{nullptr, scratch};
  std::vector<D> d0(dst.buf);
  EXPECT(cuda::merge_dense(dst.list, del.list, 0.5f, nullptr, ctx));
  bool ok = true;
  for (size_t i = 0; i < kSizes.size(); ++i) {
    const int64_t shift = dst.at(i) - dst.buf.data();
    for (int64_t j = 0; j < kSizes[i]; ++j)
      ok = ok && same_bits(dst.at(i)[j], from_f<D>(to_f(d0[shift + j]) + 0.5f * to_f(del.at(i)[j])));
  }
  EXPECT(ok);
  for (int where = 0; where < 3; ++where) {
    std::vector<D> d1(dst.buf);
    X saved;
    X* victim = where == 0 ? del.at(1) : where == 1 ? del.at(9) + 199999 : del.at(5) + 65536;
    saved = *victim;
    *victim = from_f<X>(where == 1 ? INFINITY : NAN);
    EXPECT(!cuda::merge_dense(dst.list, del.list, 0.5f, nullptr, ctx));
    EXPECT(std::memcmp(d1.data(), dst.buf.data(), d1.size() * sizeof(D)) == 0);
    *victim = saved;
  }
}

template <class I, class V, class D>
void test_sparse() {
  const int64_t n = 1001;
  std::vector<D> dst(n + 1);  // +1 so both halves of the last word exist
  for (auto& x : dst) x = from_f<D>(rnd());
  const int64_t nnz = 3000;
  std::vector<I> idx(nnz);
  std::vector<V> val(nnz);
  for (int64_t k = 0; k < nnz; ++k) { idx[k] = static_cast<I>(rng() % n); val[k] = from_f<V>(rnd()); }
  idx[0] = 0; idx[1] = n - 1; idx[2] = 0;  // duplicates + edges
  int32_t scratch[4] = {9, 9, 9, 9};
  CudaContext ctx{nullptr, scratch};
  // reference: serial in index order, fp32 add rounded once per update
  std::vector<D> ref(dst);
  for (int64_t k = 0; k < nnz; ++k) ref[idx[k]] = from_f<D>(to_f(ref[idx[k]]) + 0.25f * to_f(val[k]));
  Flat f{dst.data(), dt<D>(), n};
  EXPECT(cuda::merge_sparse(f, idx.data(), sizeof(I) == 4 ? DType::kInt32 : DType::kInt64, val.data(), dt<V>(), nnz, 0.25f, ctx));
  // emulation is serial in k order per thread... order differs; compare with tolerance for 16-bit
  bool ok = true;
  for (int64_t i = 0; i <= n; ++i) {
    const float a = to_f(dst[i]), b = to_f(ref[i]);
    ok = ok && std::fabs(a - b) <= (sizeof(D) == 4 ? 1e-5f : 0.05f) * (1 + std::fabs(b));
  }
  EXPECT(ok);
  EXPECT(same_bits(dst[n], ref[n]));  // the element past the end untouched (it's never indexed)
  // out of range: throws, writes nothing, names first bad position
  std::vector<D> before(dst);
  idx[1700] = static_cast<I>(n); idx[2500] = static_cast<I>(-1);
  val[5] = from_f<V>(NAN);
  try {
    cuda::merge_sparse(f, idx.data(), sizeof(I) == 4 ? DType::kInt32 : DType::kInt64, val.data(), dt<V>(), nnz, 0.25f, ctx);
    EXPECT(false);
  } catch (const std::out_of_range& e) {
    EXPECT(std::string(e.what()) == "indices[1700] = 1001 is out of range for a buffer of 1001 elements");
  }
  EXPECT(std::memcmp(before.data(), dst.data(), dst.size() * sizeof(D)) == 0);
  idx[1700] = 3; idx[2500] = 4;
  EXPECT(!cuda::merge_sparse(f, idx.data(), sizeof(I) == 4 ? DType::kInt32 : DType::kInt64, val.data(), dt<V>(), nnz, 0.25f, ctx));
  EXPECT(std::memcmp(before.data(), dst.data(), dst.size() * sizeof(D)) == 0);
  // empty dst, nnz > 0
  Flat empty{nullptr, dt<D>(), 0};
  val[5] = from_f<V>(1.f);
  try { cuda::merge_sparse(empty, idx.data(), sizeof(I) == 4 ? DType::kInt32 : DType::kInt64, val.data(), dt<V>(), 1, 1.f, ctx); EXPECT(false); }
  catch (const std::out_of_range& e) { EXPECT(std::string(e.what()).find("indices[0]") == 0); }
}

template <class O, class I>
void test_wsum(int K, bool misalign) {
  Store<O> out(kSizes, misalign);
  std::vector<Store<I>> in;
  std::vector<TensorList> lists;
  std::vector<float> w;
  for (int k = 0; k < K; ++k) { in.emplace_back(kSizes, (k % 2) == misalign); w.push_back(rnd()); }
  for (auto& s : in) lists.push_back(s.list);
  cuda::weighted_sum(out.list, lists, w, CudaContext{});
  bool ok = true;
  for (size_t i = 0; i < kSizes.size(); ++i)
    for (int64_t j = 0; j < kSizes[i]; ++j) {
      float acc = 0.f;
      O stored{};
      for (int k = 0; k < K; ++k) {
        const float term = w[k] * to_f(in[k].at(i)[j]);
        acc = k == 0 ? term : acc + term;
        if (k % ashl::cuda::kMaxInputs == ashl::cuda::kMaxInputs - 1 && k + 1 < K) { stored = from_f<O>(acc); acc = to_f(stored); }
      }
      ok = ok && same_bits(out.at(i)[j], from_f<O>(acc));
    }
  EXPECT(ok);
}

// ---------- both drivers of ashl/ops.h: the same bits ----------
// Every op through ashl::cpu and the emulated ashl::cuda on copies of the same
// inputs, specials included. A NaN result only has to be NaN on both: which
// NaN comes out is the hardware's choice.

template <class T> bool same_value(T a, T b) {
  return same_bits(a, b) || (std::isnan(to_f(a)) && std::isnan(to_f(b)));
}
template <class T> bool same_values(const std::vector<T>& a, const std::vector<T>& b) {
  for (size_t i = 0; i < a.size(); ++i)
    if (!same_value(a[i], b[i])) return false;
  return a.size() == b.size();
}

// Every 13th element a special value (the first 7 finite in every storage
// type); the same one at the same place in every buffer of a salt, so
// weighted sums meet all-zero positions.
template <class T> void sprinkle(std::vector<T>& v, int salt, bool finite = false) {
  const float sp[] = {0.f,     -0.f,     1e-41f,   -6e-8f,    1e-5f,     65504.f,
                      -6e4f,   70000.f,  -3.3e38f, INFINITY, -INFINITY, NAN};
  const int n = finite ? 7 : 12;
  for (size_t i = 0; i < v.size(); i += 13) v[i] = from_f<T>(sp[(i / 13 + salt) % n]);
}

// A copy whose list points into its own buffer.
template <class T> Store<T> twin(const Store<T>& s) {
  Store<T> c = s;
  for (auto& p : c.list.ptrs) p = c.buf.data() + (static_cast<T*>(p) - s.buf.data());
  return c;
}

template <class P, class F>
void agree_pack_unpack(bool misalign) {
  Store<P> prm(kSizes, misalign), anc(kSizes, misalign), res(kSizes, !misalign);
  sprinkle(prm.buf, 0); sprinkle(anc.buf, 3); sprinkle(res.buf, 5);
  int64_t fn;
  const auto off = make_offsets(kSizes, fn, misalign);
  std::vector<F> g(fn), c(fn);
  for (bool with_res : {false, true}) {
    const TensorList* r = with_res ? &res.list : nullptr;
    cuda::pack_delta(prm.list, anc.list, r, off, Flat{g.data(), dt<F>(), fn}, -0.37f, {});
    cpu::pack_delta(prm.list, anc.list, r, off, Flat{c.data(), dt<F>(), fn}, -0.37f);
    EXPECT(same_values(g, c));
  }
  Store<P> prm2 = twin(prm), anc2 = twin(anc);
  cuda::unpack_add(prm.list, anc.list, off, Flat{g.data(), dt<F>(), fn}, {});
  cpu::unpack_add(prm2.list, anc2.list, off, Flat{g.data(), dt<F>(), fn});
  EXPECT(same_values(prm.buf, prm2.buf) && same_values(anc.buf, anc2.buf));
  sprinkle(g, 1);
  cuda::unpack_assign(prm.list, anc.list, off, Flat{g.data(), dt<F>(), fn}, {});
  cpu::unpack_assign(prm2.list, anc2.list, off, Flat{g.data(), dt<F>(), fn});
  EXPECT(same_values(prm.buf, prm2.buf) && same_values(anc.buf, anc2.buf));
}

template <class D, class X>
void agree_merge_dense(bool misalign) {
  Store<D> dst(kSizes, misalign);
  Store<X> del(kSizes, !misalign);
  sprinkle(dst.buf, 0); sprinkle(del.buf, 2, true);
  Store<D> dst2 = twin(dst);
  int32_t scratch[4] = {};
  // out of place first (dst only read), on both back ends, then in place
  Store<D> out = twin(dst), out2 = twin(dst);
  EXPECT(cuda::merge_dense(dst.list, del.list, -0.3f, &out.list, {nullptr, scratch}));
  EXPECT(cpu::merge_dense(dst2.list, del.list, -0.3f, &out2.list));
  EXPECT(same_values(dst.buf, dst2.buf));
  EXPECT(cuda::merge_dense(dst.list, del.list, -0.3f, nullptr, {nullptr, scratch}));
  EXPECT(cpu::merge_dense(dst2.list, del.list, -0.3f));
  EXPECT(same_values(dst.buf, dst2.buf));
  EXPECT(same_values(out.buf, dst.buf) && same_values(out2.buf, dst.buf));
  // a NaN: out's merge is refused and dst untouched
  std::vector<D> before(dst.buf);
  *del.at(7) = from_f<X>(NAN);
  EXPECT(!cuda::merge_dense(dst.list, del.list, 1.f, &out.list, {nullptr, scratch}));
  EXPECT(!cpu::merge_dense(dst.list, del.list, 1.f, &out2.list));
  EXPECT(std::memcmp(before.data(), dst.buf.data(), before.size() * sizeof(D)) == 0);
}

template <class I, class V, class D>
void agree_sparse() {
  const int64_t n = 1001, nnz = 3000;  // duplicates: both add them in index order
  std::vector<D> dst(n);
  std::vector<I> idx(nnz);
  std::vector<V> val(nnz);
  for (auto& x : dst) x = from_f<D>(rnd());
  for (int64_t k = 0; k < nnz; ++k) { idx[k] = static_cast<I>(rng() % n); val[k] = from_f<V>(rnd()); }
  sprinkle(dst, 0); sprinkle(val, 4, true);
  std::vector<D> dst2(dst);
  const DType it = sizeof(I) == 4 ? DType::kInt32 : DType::kInt64;
  int32_t scratch[4] = {};
  EXPECT(cuda::merge_sparse(Flat{dst.data(), dt<D>(), n}, idx.data(), it, val.data(), dt<V>(), nnz, 0.7f, {nullptr, scratch}));
  EXPECT(cpu::merge_sparse(Flat{dst2.data(), dt<D>(), n}, idx.data(), it, val.data(), dt<V>(), nnz, 0.7f));
  EXPECT(same_values(dst, dst2));
}

// K > kMaxInputs only with fp32 out: CUDA rounds the running sum to out's
// storage between passes.
template <class O, class I>
void agree_wsum(int K, bool misalign, bool negative) {
  Store<O> out(kSizes, misalign);
  Store<O> out2 = twin(out);
  std::vector<Store<I>> in;
  std::vector<TensorList> lists;
  std::vector<float> w;
  for (int k = 0; k < K; ++k) {
    in.emplace_back(kSizes, (k % 2) == misalign);
    sprinkle(in.back().buf, 0);
    w.push_back(negative ? -0.5f - 0.1f * k : rnd());
  }
  for (auto& s : in) lists.push_back(s.list);
  cuda::weighted_sum(out.list, lists, w, {});
  cpu::weighted_sum(out2.list, lists, w);
  EXPECT(same_values(out.buf, out2.buf));
}

void agree() {
#define AGREE_PU(P, F) for (int m = 0; m < 2; ++m) agree_pack_unpack<P, F>(m);
  AGREE_PU(float, float) AGREE_PU(float, __half) AGREE_PU(float, __nv_bfloat16)
  AGREE_PU(__half, float) AGREE_PU(__half, __half) AGREE_PU(__half, __nv_bfloat16)
  AGREE_PU(__nv_bfloat16, float) AGREE_PU(__nv_bfloat16, __half) AGREE_PU(__nv_bfloat16, __nv_bfloat16)
#define AGREE_MD(D, X) for (int m = 0; m < 2; ++m) agree_merge_dense<D, X>(m);
  AGREE_MD(float, float) AGREE_MD(float, __half) AGREE_MD(__half, float)
  AGREE_MD(__nv_bfloat16, __half) AGREE_MD(__half, __nv_bfloat16) AGREE_MD(__nv_bfloat16, float)
  agree_sparse<int32_t, float, float>();
  agree_sparse<int64_t, __half, float>();
  agree_sparse<int32_t, float, __half>();
  agree_sparse<int64_t, __nv_bfloat16, __nv_bfloat16>();
  for (int K : {0, 1, 3, 4, 5, 8}) {
    for (bool neg : {false, true}) {
      agree_wsum<float, float>(K, false, neg); agree_wsum<__half, float>(K, true, neg);
      agree_wsum<__nv_bfloat16, __half>(K, false, neg); agree_wsum<float, __nv_bfloat16>(K, true, neg);
    }
  }
  for (int K : {9, 17}) { agree_wsum<float, float>(K, false, true); agree_wsum<float, __half>(K, true, false); }
  std::printf("cpu == emulated cuda done\n");
}

template <class T, class F>
void expect_throw(F&& f, const char* what) {
  try { f(); ++failures; std::printf("FAIL: no throw: %s\n", what); }
  catch (const T&) {}
  catch (const std::exception& e) { ++failures; std::printf("FAIL: wrong exception for %s: %s\n", what, e.what()); }
}

int main() {
  // coverage: many small tensors (> kTensors), chunk boundaries, > kBlocks chunks, misalignment
  std::vector<int64_t> many(300);
  for (size_t i = 0; i < many.size(); ++i) many[i] = (i * 7919) % 300;
  coverage<1>(many, 0, false);
  coverage<3>(many, 3, false);
  coverage<9>(many, 0, true);
  coverage<2>({int64_t(kChunk) * kBlocks + 5, 3, int64_t(kChunk) * kBlocks, 0, 1}, 0, false);
  coverage<4>({1, int64_t(kChunk) * (kBlocks - 1), int64_t(kChunk) * 2 + 1, 65535, 65536, 65537}, 2, false);
  {
    std::vector<int64_t> v(64 * 3, kChunk);  // exactly kTensors-sized batches
    coverage<1>(v, 0, false);
    std::vector<int64_t> u(200, 2 * kChunk - 1);
    coverage<2>(u, 5, false);
  }
  coverage<3>({}, 0, false);
  coverage<3>({0, 0, 0}, 0, false);

#define PU(P, F) for (int m = 0; m < 2; ++m) for (int o = 0; o < 2; ++o) for (int r = 0; r < 2; ++r) test_pack_unpack<P, F>(m, o, r);
  PU(float, float) PU(float, __half) PU(float, __nv_bfloat16)
  PU(__half, float) PU(__half, __half) PU(__half, __nv_bfloat16)
  PU(__nv_bfloat16, float) PU(__nv_bfloat16, __half) PU(__nv_bfloat16, __nv_bfloat16)
  std::printf("pack/unpack done\n");
#define MD(D, X) for (int m = 0; m < 2; ++m) test_merge_dense<D, X>(m);
  MD(float, float) MD(float, __half) MD(__half, float) MD(__nv_bfloat16, __half) MD(__half, __half) MD(__nv_bfloat16, __nv_bfloat16)
  std::printf("merge_dense done\n");
  test_sparse<int32_t, float, float>();
  test_sparse<int64_t, float, __half>();
  test_sparse<int32_t, __half, __nv_bfloat16>();
  test_sparse<int64_t, __nv_bfloat16, __half>();
  std::printf("merge_sparse done\n");
  for (int K : {0, 1, 3, 8, 9, 11, 17}) { test_wsum<float, float>(K, false); test_wsum<__half, float>(K, true); test_wsum<__nv_bfloat16, __half>(K, false); }
  std::printf("weighted_sum done\n");
  agree();

  // aliasing: out == inputs[0] fine, out == inputs[9] rejected
  {
    Store<float> a(kSizes, false);
    std::vector<Store<float>> in;
    for (int k = 0; k < 10; ++k) in.emplace_back(kSizes, false);
    std::vector<TensorList> l;
    for (auto& s : in) l.push_back(s.list);
    std::vector<float> w(10, 0.1f);
    l[0] = a.list;
    cuda::weighted_sum(a.list, l, w, CudaContext{});
    l[0] = in[0].list; l[9] = a.list;
    expect_throw<std::invalid_argument>([&] { cuda::weighted_sum(a.list, l, w, CudaContext{}); }, "alias");
  }

  // validation
  Store<float> p(kSizes, false), q(kSizes, false);
  int64_t fn;
  auto off = make_offsets(kSizes, fn, false);
  std::vector<float> flat(fn);
  Flat out{flat.data(), DType::kFloat32, fn};
  TensorList bad = p.list; bad.dtype = DType::kInt32;
  expect_throw<std::invalid_argument>([&] { cuda::pack_delta(bad, bad, nullptr, off, out, 1.f, {}); }, "int params");
  expect_throw<std::invalid_argument>([&] { cuda::pack_delta(p.list, q.list, nullptr, off, Flat{flat.data(), DType::kInt64, fn}, 1.f, {}); }, "int flat");
  expect_throw<std::invalid_argument>([&] { cuda::pack_delta(p.list, q.list, nullptr, off, Flat{flat.data(), DType::kFloat32, fn - 3}, 1.f, {}); }, "flat too small");
  expect_throw<std::invalid_argument>([&] { cuda::pack_delta(p.list, q.list, nullptr, off, out, NAN, {}); }, "nan scale");
  int32_t sc0[4] = {};
  TensorList h = q.list; h.dtype = DType::kFloat16;
  expect_throw<std::invalid_argument>([&] { cuda::pack_delta(p.list, h, nullptr, off, out, 1.f, {}); }, "mixed dtype");
  expect_throw<std::invalid_argument>([&] { cuda::merge_dense(p.list, q.list, 1.f, nullptr, {}); }, "null scratch");
  expect_throw<std::invalid_argument>([&] { cpu::merge_dense(p.list, q.list, 1.f, &p.list); }, "out is dst");
  expect_throw<std::invalid_argument>([&] { cuda::merge_dense(p.list, q.list, 1.f, &p.list, {nullptr, sc0}); }, "cuda out is dst");
  TensorList o2 = q.list; o2.numels[2] += 1;
  expect_throw<std::invalid_argument>([&] { cpu::merge_dense(p.list, q.list, 1.f, &o2); }, "out shape");
  expect_throw<std::invalid_argument>([&] { cuda::weighted_sum(p.list, {q.list}, {1.f, 2.f}, {}); }, "weights size");
  TensorList q2 = q.list; q2.numels[3] += 1;
  expect_throw<std::invalid_argument>([&] { cuda::weighted_sum(p.list, {q2}, {1.f}, {}); }, "shape");
  TensorList q3 = q.list; q3.ptrs[4] = nullptr;
  expect_throw<std::invalid_argument>([&] { cuda::merge_dense(p.list, q3, 1.f, nullptr, {}); }, "null ptr");
  int64_t one = 1; int32_t sc[4];
  expect_throw<std::invalid_argument>([&] { cuda::merge_sparse(Flat{flat.data(), DType::kFloat32, fn}, &one, DType::kFloat32, flat.data(), DType::kFloat32, 1, 1.f, {nullptr, sc}); }, "float indices");
  expect_throw<std::invalid_argument>([&] { cuda::merge_sparse(Flat{flat.data(), DType::kFloat32, fn}, &one, DType::kInt64, flat.data(), DType::kFloat32, 1, 1.f, {}); }, "sparse null scratch");
  expect_throw<std::invalid_argument>([&] { cuda::merge_sparse(Flat{flat.data(), DType::kFloat32, fn}, &one, DType::kInt64, flat.data(), DType::kFloat32, -1, 1.f, {nullptr, sc}); }, "neg nnz");
  // empty work: no scratch needed, nothing touched
  TensorList empty; empty.dtype = DType::kFloat16;
  cuda::pack_delta(empty, empty, &empty, {}, Flat{nullptr, DType::kFloat32, 0}, 1.f, {});
  cuda::unpack_assign(empty, empty, {}, Flat{nullptr, DType::kBFloat16, 0}, {});
  cuda::unpack_add(empty, empty, {}, Flat{nullptr, DType::kBFloat16, 0}, {});
  EXPECT(cuda::merge_dense(empty, empty, 1.f, nullptr, {}));
  EXPECT(cuda::merge_sparse(Flat{nullptr, DType::kFloat32, 0}, nullptr, DType::kInt32, nullptr, DType::kFloat32, 0, 1.f, {}));
  cuda::weighted_sum(empty, {}, {}, {});
  TensorList zeros; zeros.dtype = DType::kFloat32; zeros.ptrs = {nullptr, nullptr}; zeros.numels = {0, 0};
  EXPECT(cuda::merge_dense(zeros, zeros, 1.f, nullptr, {}));
  cuda::weighted_sum(zeros, {zeros, zeros}, {1.f, 2.f}, {});
  EXPECT(!cuda::available());
  std::printf("%s (%d failures)\n", failures ? "FAILED" : "ALL PASSED", failures);
  return failures != 0;
}
