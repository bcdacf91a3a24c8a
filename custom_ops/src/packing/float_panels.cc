// Placement of the formats that hold the weights' elements (panel_layout.h): float panels, int8 pairs,
// quads and octets, bf16 pairs. Whole tiles of 16 columns go through the ISA table's transpose_tile where
// every lane's column has its k consecutive; the rest element by element in runs of 16 k.
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <type_traits>

#include "bf16_gemm.h"
#include "float_rows.h"
#include "int8_gemm.h"
#include "isa.h"
#include "panel_layout.h"

namespace moe_onnx {
namespace {

size_t element_bytes(WeightFormat format) {
  if (format == WeightFormat::kInt8Quads || format == WeightFormat::kInt8Octets) return 1;
  return format == WeightFormat::kF32 ? 4 : 2;
}

// Packed elements of one expert's B [K, N].
int64_t slot_elements(WeightFormat format, int64_t N, int64_t K) {
  if (format == WeightFormat::kInt8Quads) return panel_count(N) * int8_quad_panel_bytes(K);
  if (format == WeightFormat::kInt8Octets) return panel_count(N) * kPanel * 8 * int8_octets(K);
  if (format == WeightFormat::kBF16Pairs) return panel_count(N) * bf16_pair_panel_elements(K);
  return panel_count(N) * kPanel * (format == WeightFormat::kInt8 ? 2 * int8_pairs(K) : K);
}

// The placement of each format, in elements of one expert's panels (K rows): where panel `panel`
// starts, where its rows start (after the quad panels' corrections), lane `lane` at k = 0 from
// there, and row k of a lane from there.
template <WeightFormat F>
int64_t panel_offset(int64_t K, int64_t panel) {
  if (F == WeightFormat::kInt8) return panel * int8_pairs(K) * 2 * kPanel;
  if (F == WeightFormat::kInt8Quads) return panel * int8_quad_panel_bytes(K);
  if (F == WeightFormat::kInt8Octets) return panel * int8_octets(K) * 8 * kPanel;
  if (F == WeightFormat::kBF16Pairs) return panel * bf16_pair_panel_elements(K);
  return panel * K * kPanel;
}
template <WeightFormat F>
constexpr int64_t header_elements() {
  return F == WeightFormat::kInt8Quads ? kInt8QuadHeader : 0;
}
template <WeightFormat F>
int64_t lane_offset(int64_t lane) {
  if (F == WeightFormat::kInt8Quads) return lane * 4;
  if (F == WeightFormat::kInt8Octets) return lane * 8;
  if (F == WeightFormat::kInt8 || F == WeightFormat::kBF16Pairs) return lane * 2;
  if (F == WeightFormat::kBF16) return bf16_lane(lane);
  return lane;
}
template <WeightFormat F>
int64_t row_offset(int64_t k) {
  if (F == WeightFormat::kInt8Quads) return (k / 4) * 4 * kPanel + k % 4;
  if (F == WeightFormat::kInt8Octets) return (k / 8) * 8 * kPanel + k % 8;
  const bool pairs = F == WeightFormat::kInt8 || F == WeightFormat::kBF16Pairs;
  return pairs ? (k / 2) * 2 * kPanel + k % 2 : k * kPanel;
}


// Writes a quad panel's corrections: -128 * (the sum of its column's weights), wrapping like the
// GEMM's int32 sums.
void store_quad_corrections(int8_t* panel, int64_t K) {
  const int8_t* weights = panel + kInt8QuadHeader;
  uint32_t sums[4 * kPanel] = {};  // per byte of a quad row (lane c: bytes 4c..4c+3), summed down the quads
  for (int64_t q = 0; q < int8_quads(K); ++q)
    for (int64_t b = 0; b < 4 * kPanel; ++b) sums[b] += static_cast<uint32_t>(weights[q * 4 * kPanel + b]);
  uint32_t corrections[kPanel];
  for (int64_t c = 0; c < kPanel; ++c) corrections[c] = 0u - 128u * (sums[4 * c] + sums[4 * c + 1] + sums[4 * c + 2] + sums[4 * c + 3]);
  std::memcpy(panel, corrections, sizeof corrections);
}

// Where each lane of one panel comes from: the first element of its column (k = 0) and the stride
// of k, or no column (a zero lane).
struct PanelLanes {
  const void* column[kPanel];
  int64_t k_stride[kPanel];
  bool full;           // every lane has a column
  bool k_consecutive;  // and each column's k are consecutive elements

  PanelLanes(std::initializer_list<ColumnSource> sources, int64_t panel, size_t element_bytes)
      : column{}, k_stride{}, full(true), k_consecutive(true) {
    for (const ColumnSource& src : sources)
      for (int64_t lane = src.lane0; lane < src.lane0 + src.width; ++lane) {
        const int64_t c = panel * src.width + lane - src.lane0;
        if (c < src.columns) {
          column[lane] = column_start(src, c, element_bytes);
          k_stride[lane] = src.k_stride;
        }
      }
    for (int64_t lane = 0; lane < kPanel; ++lane) {
      full = full && column[lane];
      k_consecutive = k_consecutive && k_stride[lane] == 1;
    }
  }
  static const void* column_start(const ColumnSource& src, int64_t c, size_t element_bytes) {
    return static_cast<const char*>(src.data) + (src.first + c * src.c_stride) * static_cast<int64_t>(element_bytes);
  }
};

// Rows of k a panel of format F holds for K weights (padding rows are zero).
template <WeightFormat F>
int64_t padded_rows(int64_t K) {
  if (F == WeightFormat::kInt8) return 2 * int8_pairs(K);
  if (F == WeightFormat::kInt8Quads) return 4 * int8_quads(K);
  if (F == WeightFormat::kInt8Octets) return 8 * int8_octets(K);
  if (F == WeightFormat::kBF16Pairs) return bf16_padded_k(K);
  return K;
}

// The conversion of the formats that hold the weights' own values (int8 pairs: widened to int16).
template <class Dst>
struct Cast {
  template <class Src>
  Dst operator()(Src value) const {
    return static_cast<Dst>(value);
  }
};

// Writes rows [0, k) of a panel of format F (its body: after the header) with the table's tile copy
// (transpose_tile.h) and returns k, a multiple of the rows one copy writes; 0 where the copy does not
// serve: a lane without a column, columns whose k are not consecutive, or a format that changes the
// elements (int8 pairs widen them; bf16 pairs from fp32 are rounded first, 32 k of each column at a
// time, as float_to_bf16 rounds them). A tile element is the k of a row pair (bf16 pairs) or quad
// (int8 quads) side by side; bf16 panels take their columns in bf16_lane's order. (int8 octets, 8-byte
// elements, which the tile copies do not take, go element by element.)
template <WeightFormat F, class Src, class Dst, class Convert>
int64_t place_whole_tiles(const PanelLanes& lanes, int64_t K, Dst* body) {
  constexpr bool rounded = F == WeightFormat::kBF16Pairs && std::is_same_v<Src, float>;
  constexpr bool copied = std::is_same_v<Src, Dst> && std::is_same_v<std::decay_t<Convert>, Cast<Dst>> &&
                          F != WeightFormat::kInt8Octets;
  if constexpr (!rounded && !copied) {
    return 0;
  } else {
    if (!lanes.full || !lanes.k_consecutive) return 0;
    constexpr int64_t per_element = F == WeightFormat::kInt8Quads ? 4 : F == WeightFormat::kBF16Pairs ? 2 : 1;
    constexpr int64_t rows = kPanel * per_element;
    constexpr int bytes = static_cast<int>(per_element * sizeof(Dst));
    const auto transpose = kernels().transpose_tile;
    alignas(64) uint16_t bf16[rounded ? kPanel : 1][rounded ? rows : 1];
    const void* columns[kPanel];
    const int64_t whole = K / rows * rows;
    for (int64_t k0 = 0; k0 < whole; k0 += rows) {
      for (int64_t lane = 0; lane < kPanel; ++lane) {
        // bf16 panels: row position j holds column c with bf16_lane(c) = j
        const int64_t c = F == WeightFormat::kBF16 ? (lane % 2 ? kPanel / 2 + lane / 2 : lane / 2) : lane;
        const Src* in = static_cast<const Src*>(lanes.column[c]) + k0;
        if constexpr (rounded) {
          narrow_row(FloatType::kBF16, in, bf16[lane], rows);
          columns[lane] = bf16[lane];
        } else {
          columns[lane] = in;
        }
      }
      transpose(columns, bytes, body + k0 * kPanel);
    }
    return whole;
  }
}

// Writes one panel of format F (K rows) at `panel`, from `lanes` of Src elements, `convert` one to
// Dst: whole tiles with the tile copy where it serves (place_whole_tiles), the rest in tiles of 16 k,
// so each tile's reads are 16 short runs of each column and its writes stay in L1. A panel with zero
// lanes or padding rows is zeroed first, while it is in cache.
template <WeightFormat F, class Src, class Dst, class Convert>
void place_panel(const PanelLanes& lanes, int64_t K, Dst* panel, Convert&& convert) {
  constexpr int64_t kTile = 16;
  Dst* body = panel + header_elements<F>();
  if (!lanes.full || padded_rows<F>(K) != K)
    std::memset(body, 0, static_cast<size_t>(padded_rows<F>(K) * kPanel) * sizeof(Dst));
  for (int64_t k0 = place_whole_tiles<F, Src, Dst, Convert>(lanes, K, body); k0 < K; k0 += kTile) {
    const int64_t k1 = std::min(K, k0 + kTile);
    for (int64_t lane = 0; lane < kPanel; ++lane) {
      const Src* in = static_cast<const Src*>(lanes.column[lane]);
      if (!in) continue;
      const int64_t ks = lanes.k_stride[lane];
      Dst* out = body + lane_offset<F>(lane);
      for (int64_t k = k0; k < k1; ++k) out[row_offset<F>(k)] = convert(in[k * ks]);
    }
  }
  if (F == WeightFormat::kInt8Quads) store_quad_corrections(reinterpret_cast<int8_t*>(panel), K);
}

// Writes one expert's panels of format F (K rows, N columns) from `sources`.
template <WeightFormat F, class Src, class Dst, class Convert>
void place(std::initializer_list<ColumnSource> sources, int64_t N, int64_t K, Dst* dst, Convert&& convert) {
  for (int64_t p = 0; p < panel_count(N); ++p)
    place_panel<F, Src>(PanelLanes(sources, p, sizeof(Src)), K, dst + panel_offset<F>(K, p), convert);
}
template <WeightFormat F, class Src, class Dst>
void place(std::initializer_list<ColumnSource> sources, int64_t N, int64_t K, Dst* dst) {
  place<F, Src>(sources, N, K, dst, Cast<Dst>{});
}

// Weights of `source` type into bf16 pair panels, rounded to nearest even.
void place_bf16_pairs(FloatType source, std::initializer_list<ColumnSource> sources, int64_t N, int64_t K,
                      uint16_t* dst) {
  constexpr WeightFormat F = WeightFormat::kBF16Pairs;
  switch (source) {
    case FloatType::kF32: return place<F, float>(sources, N, K, dst, float_to_bf16);
    case FloatType::kF16:
      return place<F, uint16_t>(sources, N, K, dst, [](uint16_t h) { return float_to_bf16(half_to_float(h)); });
    case FloatType::kBF16: return place<F, uint16_t>(sources, N, K, dst);
  }
}

}  // namespace

int64_t panel_slot_bytes(WeightFormat format, int64_t N, int64_t K) {
  return slot_elements(format, N, K) * static_cast<int64_t>(element_bytes(format));
}

void place_panels(WeightFormat format, FloatType source, std::initializer_list<ColumnSource> sources, int64_t N,
                  int64_t K, void* dst) {
  switch (format) {
    case WeightFormat::kF32: return place<WeightFormat::kF32, float>(sources, N, K, static_cast<float*>(dst));
    case WeightFormat::kF16: return place<WeightFormat::kF16, uint16_t>(sources, N, K, static_cast<uint16_t*>(dst));
    case WeightFormat::kBF16: return place<WeightFormat::kBF16, uint16_t>(sources, N, K, static_cast<uint16_t*>(dst));
    case WeightFormat::kInt8: return place<WeightFormat::kInt8, int8_t>(sources, N, K, static_cast<int16_t*>(dst));
    case WeightFormat::kInt8Quads:
      return place<WeightFormat::kInt8Quads, int8_t>(sources, N, K, static_cast<int8_t*>(dst));
    case WeightFormat::kInt8Octets:
      return place<WeightFormat::kInt8Octets, int8_t>(sources, N, K, static_cast<int8_t*>(dst));
    case WeightFormat::kBF16Pairs: return place_bf16_pairs(source, sources, N, K, static_cast<uint16_t*>(dst));
    case WeightFormat::kQuantized:
      throw std::logic_error("internal: quantized panels are placed by place_quantized_panels");
  }
}

}  // namespace moe_onnx
