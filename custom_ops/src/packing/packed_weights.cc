#include "packed_weights.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#if defined(__linux__)
#include <sys/mman.h>
#endif
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>

#include "allocation.h"
#include "float_rows.h"
#include "int8_gemm.h"
#include "isa.h"

namespace moe_onnx {
namespace {

// A buffer for panels, not touched here (pack writes every byte of a slot). Large ones (Linux) are an
// anonymous mapping with MAP_NORESERVE: every slot's address space is reserved without committing
// memory, so only the slots pack writes take any, and a model larger than memory plus swap still
// starts (its experts packed on first use, or its panels mapped from a packed-weights file, when
// this buffer is never touched); 2 MB aligned and marked for transparent huge pages, so streaming
// hundreds of MB of panels does not miss the TLB every 4 KB. `mapped`: the mapping's bytes (munmap),
// 0 for malloc's (std::free).
char* allocate_panels(size_t bytes, size_t* mapped) {
  constexpr size_t kHuge = size_t{2} << 20;
  *mapped = 0;
  if (bytes < 2 * kHuge) {
    void* p = std::malloc(bytes ? bytes : 1);
    if (!p) throw std::bad_alloc();
    return static_cast<char*>(p);
  }
  const size_t rounded = (bytes + kHuge - 1) / kHuge * kHuge;
#if defined(__linux__)
  if (rounded > SIZE_MAX - kHuge) throw std::bad_alloc();
  const size_t span = rounded + kHuge;  // room to align the start to 2 MB; the ends are unmapped
  void* m = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) throw std::bad_alloc();
  const uintptr_t start = reinterpret_cast<uintptr_t>(m), aligned = (start + kHuge - 1) / kHuge * kHuge;
  if (aligned > start) munmap(m, aligned - start);
  const uintptr_t end = aligned + rounded;
  if (start + span > end) munmap(reinterpret_cast<void*>(end), start + span - end);
  char* p = reinterpret_cast<char*>(aligned);
#ifdef MADV_HUGEPAGE
  madvise(p, rounded, MADV_HUGEPAGE);  // a hint: failure only costs TLB misses
#endif
  *mapped = rounded;
  return p;
#else
  void* p = std::aligned_alloc(kHuge, rounded);
  if (!p) throw std::bad_alloc();
  return static_cast<char*>(p);
#endif
}

size_t element_bytes(WeightFormat format) {
  if (format == WeightFormat::kInt8Quads) return 1;
  return format == WeightFormat::kF32 ? 4 : 2;
}

// Packed elements of one expert's B [K, N].
int64_t slot_elements(WeightFormat format, int64_t N, int64_t K) {
  if (format == WeightFormat::kInt8Quads) return panel_count(N) * int8_quad_panel_bytes(K);
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
  if (F == WeightFormat::kInt8 || F == WeightFormat::kBF16Pairs) return lane * 2;
  if (F == WeightFormat::kBF16) return bf16_lane(lane);
  return lane;
}
template <WeightFormat F>
int64_t row_offset(int64_t k) {
  if (F == WeightFormat::kInt8Quads) return (k / 4) * 4 * kPanel + k % 4;
  const bool pairs = F == WeightFormat::kInt8 || F == WeightFormat::kBF16Pairs;
  return pairs ? (k / 2) * 2 * kPanel + k % 2 : k * kPanel;
}

// The panels' element type of a float format.
FloatType panel_type(WeightFormat format) {
  switch (format) {
    case WeightFormat::kF16: return FloatType::kF16;
    case WeightFormat::kBF16: return FloatType::kBF16;
    default: return FloatType::kF32;
  }
}

bool is_int8(WeightFormat format) { return format == WeightFormat::kInt8 || format == WeightFormat::kInt8Quads; }

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
// (int8 quads) side by side; bf16 panels take their columns in bf16_lane's order.
template <WeightFormat F, class Src, class Dst, class Convert>
int64_t place_whole_tiles(const PanelLanes& lanes, int64_t K, Dst* body) {
  constexpr bool rounded = F == WeightFormat::kBF16Pairs && std::is_same_v<Src, float>;
  constexpr bool copied = std::is_same_v<Src, Dst> && std::is_same_v<std::decay_t<Convert>, Cast<Dst>>;
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

// ------------------------------------------------------------------ quantized panels (qgemm.h)

// An E8M0 scale: 2^(s - 127) (s = 0: 2^-127, a subnormal float), NaN for 255; as bits, so that a
// panel's 16 scales convert without a call each.
float e8m0_to_float(uint8_t s) {
  const uint32_t bits = s == 255 ? 0x7FC00000u : s == 0 ? 0x00400000u : uint32_t{s} << 23;
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

// Element i of a tensor of `bits`-bit elements (4: the low nibble of a byte first).
int quant_element(const uint8_t* data, int64_t i, int bits) {
  return bits == 8 ? data[i] : (data[i / 2] >> (4 * (i % 2))) & 15;
}

// Where each lane of one quantized panel comes from: its column's source, first code (an element),
// first scale and first zero point (block 0), or no column.
struct QuantLanes {
  const QuantizedColumns* source[kPanel];  // null: no column
  int64_t codes[kPanel], scales[kPanel], zero_points[kPanel];
  FloatType scale_type[kPanel];  // int codes: the type of the lane's scales
  bool full;                     // every lane has a column
  bool codes_at_bytes;           // and each column's codes start at a byte
  int scale_bytes;               // every lane's scales' element bytes (E8M0: 1), or 0 where they differ

  QuantLanes(const QuantPanels& q, std::initializer_list<QuantizedColumns> sources, int64_t panel)
      : source{}, codes{}, scales{}, zero_points{}, scale_type{}, full(true), codes_at_bytes(true), scale_bytes(0) {
    const bool e8m0 = q.code == QuantCode::kE2M1;
    for (const QuantizedColumns& src : sources) {
      const FloatType type = e8m0 ? FloatType::kF32 : float_type(src.scale_type);
      for (int64_t lane = src.lane0; lane < src.lane0 + src.width; ++lane) {
        const int64_t c = panel * src.width + lane - src.lane0;
        if (c >= src.columns) break;
        source[lane] = &src;
        codes[lane] = src.codes_first + c * src.codes_stride;
        scales[lane] = src.scales_first + c * src.scales_stride;
        zero_points[lane] = src.zero_points_first + c * src.zero_points_stride;
        scale_type[lane] = type;
      }
    }
    bool one_scale_type = true;
    for (int64_t lane = 0; lane < kPanel; ++lane) {
      full = full && source[lane];
      codes_at_bytes = full && codes_at_bytes && codes[lane] * q.bits() % 8 == 0;
      one_scale_type = one_scale_type && scale_type[lane] == scale_type[0];
    }
    if (full && one_scale_type) scale_bytes = e8m0 ? 1 : scale_type[0] == FloatType::kF32 ? 4 : 2;
  }

  // Block b's scale of a lane (with a column), as fp32.
  float scale(QuantCode code, int64_t lane, int64_t b) const {
    const void* all = source[lane]->scales;
    if (code == QuantCode::kE2M1) return e8m0_to_float(static_cast<const uint8_t*>(all)[scales[lane] + b]);
    return load_float(scale_type[lane], all, scales[lane] + b);
  }
  // Block b's zero point of a lane (with a column): its own, or 2^(bits - 1) for a linear without zero
  // points that shares the panels with one that has them.
  uint8_t zero_point(int bits, int64_t lane, int64_t b) const {
    const QuantizedColumns& src = *source[lane];
    if (!src.zero_points) return static_cast<uint8_t>(1 << (bits - 1));
    const int64_t i = zero_points[lane] + b * src.zero_points_block_stride;
    return static_cast<uint8_t>(quant_element(src.zero_points, i, bits));
  }
  // The zero points of blocks [b0, b0 + 16) of a lane (with a column) into out.
  void zero_points_of(int bits, int64_t lane, int64_t b0, uint8_t out[16]) const {
    const QuantizedColumns& src = *source[lane];
    const int64_t first = zero_points[lane] + b0 * src.zero_points_block_stride;
    if (!src.zero_points || src.zero_points_block_stride != 1 || (bits == 4 && first % 2)) {
      for (int64_t i = 0; i < 16; ++i) out[i] = zero_point(bits, lane, b0 + i);
    } else if (bits == 8) {
      std::memcpy(out, src.zero_points + first, 16);
    } else {
      const uint8_t* in = src.zero_points + first / 2;
      for (int64_t i = 0; i < 8; ++i) {
        out[2 * i] = in[i] & 15;
        out[2 * i + 1] = in[i] >> 4;
      }
    }
  }
};

// Writes the headers of a panel's blocks (scales, zero points) for the lanes with a column: 16 blocks at
// a time where every lane has one and their scales one type (the lanes' 16 scales and 16 zero points
// side by side with the tile copy, transpose_tile.h, then each block's 16 scales converted in a row),
// the other blocks element by element.
void place_quant_headers(const QuantPanels& q, const QuantLanes& lanes, uint8_t* panel) {
  constexpr int64_t kTile = 16;
  const int64_t blocks = q.blocks(), block_bytes = q.block_bytes();
  const int bits = q.bits();
  int64_t b0 = 0;
  if (lanes.scale_bytes) {
    const auto transpose = kernels().transpose_tile;
    const int64_t scale_bytes = lanes.scale_bytes;
    alignas(64) uint8_t scale_rows[kTile * kPanel * 4];
    alignas(64) uint8_t zero_points[kPanel][kTile], zero_point_rows[kTile][kPanel];
    const void* columns[kPanel];
    for (; b0 + kTile <= blocks; b0 += kTile) {
      for (int64_t lane = 0; lane < kPanel; ++lane) {
        const auto* scales = static_cast<const char*>(lanes.source[lane]->scales);
        columns[lane] = scales + (lanes.scales[lane] + b0) * scale_bytes;
      }
      transpose(columns, lanes.scale_bytes, scale_rows);
      for (int64_t i = 0; i < kTile; ++i) {
        const uint8_t* row = scale_rows + i * kPanel * scale_bytes;
        uint8_t* header = panel + (b0 + i) * block_bytes;
        if (q.code == QuantCode::kE2M1) {
          for (int64_t lane = 0; lane < kPanel; ++lane) {
            const float scale = e8m0_to_float(row[lane]);
            std::memcpy(header + 4 * lane, &scale, 4);
          }
        } else if (scale_bytes == 4) {
          std::memcpy(header, row, kPanel * 4);
        } else {
          widen_row(lanes.scale_type[0], row, reinterpret_cast<float*>(header), kPanel);
        }
      }
      if (!q.zero_points) continue;
      for (int64_t lane = 0; lane < kPanel; ++lane) {
        lanes.zero_points_of(bits, lane, b0, zero_points[lane]);
        columns[lane] = zero_points[lane];
      }
      transpose(columns, 1, zero_point_rows);
      for (int64_t i = 0; i < kTile; ++i)
        std::memcpy(panel + (b0 + i) * block_bytes + 64, zero_point_rows[i], sizeof zero_point_rows[i]);
    }
  }
  for (int64_t b = b0; b < blocks; ++b) {
    uint8_t* header = panel + b * block_bytes;
    for (int64_t lane = 0; lane < kPanel; ++lane) {
      if (!lanes.source[lane]) continue;
      const float scale = lanes.scale(q.code, lane, b);
      std::memcpy(header + 4 * lane, &scale, 4);
      if (q.zero_points) header[64 + lane] = lanes.zero_point(bits, lane, b);
    }
  }
}

// Rows of each block that the table's quant_code_groups writes (codes that start at a byte): its whole
// groups, where the blocks are whole groups or there is one block (per-column scales).
int64_t grouped_rows(const QuantPanels& q) {
  const int64_t whole = q.block / q.group_rows() * q.group_rows();
  return whole == q.block || q.blocks() == 1 ? whole : 0;
}

// Writes the codes of a panel's blocks: rows [0, grouped) of every block with the table's
// quant_code_groups (transpose_tile.h), the others (a per-column block's last rows; every row of a
// panel with a lane without a column, or with codes from the middle of a byte) element by element into
// the zeroed panel.
void place_quant_codes(const QuantPanels& q, const QuantLanes& lanes, int64_t grouped, uint8_t* panel) {
  const int bits = q.bits();
  const int64_t G = q.group_rows(), block_bytes = q.block_bytes(), blocks = q.blocks();
  const int group_shift = bits == 8 ? 2 : 3;  // log2(G)
  uint8_t* codes = panel + q.header_bytes();
  if (grouped > 0) {
    const uint8_t* starts[kPanel];
    for (int64_t lane = 0; lane < kPanel; ++lane)
      starts[lane] = lanes.source[lane]->codes + lanes.codes[lane] * bits / 8;
    kernels().quant_code_groups(starts, blocks * (grouped / G), q.groups_per_block(), block_bytes, bits == 4, codes);
  }
  if (grouped == q.block) return;
  for (int64_t lane = 0; lane < kPanel; ++lane) {
    if (!lanes.source[lane]) continue;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t first = lanes.codes[lane] + b * q.block;
      uint8_t* block = codes + b * block_bytes + 4 * lane;
      for (int64_t kk = grouped; kk < q.block; ++kk) {
        const int code = quant_element(lanes.source[lane]->codes, first + kk, bits);
        const int64_t i = kk & (G - 1);
        uint8_t& byte = block[(kk >> group_shift) * kQuantGroupBytes + (bits == 8 ? i : i % 4)];
        byte = static_cast<uint8_t>(bits == 8 ? code : byte | code << (i < 4 ? 0 : 4));
      }
    }
  }
}

}  // namespace

namespace detail {

void quant_code_groups_portable(const uint8_t* const* lanes, int64_t groups, int64_t per_block, int64_t block_bytes,
                                bool nibbles, uint8_t* out) {
  GroupPlaces places(out, per_block, block_bytes);
  for (int64_t j = 0; j < groups; ++j) {
    uint8_t* group = places.next();
    for (int64_t lane = 0; lane < kPanel; ++lane) {
      uint32_t word;
      std::memcpy(&word, lanes[lane] + 4 * j, 4);
      if (nibbles) word = interleave_nibbles(word);
      std::memcpy(group + 4 * lane, &word, 4);
    }
  }
}

void transpose_tile_portable(const void* const* columns, int bytes, void* rows) {
  for (int r = 0; r < kPanel; ++r)
    for (int c = 0; c < kPanel; ++c)
      std::memcpy(static_cast<char*>(rows) + (r * kPanel + c) * bytes, static_cast<const char*>(columns[c]) + r * bytes,
                  static_cast<size_t>(bytes));
}

}  // namespace detail

bool bf16_compute_available() { return static_cast<bool>(kernels().bf16_gemm); }

WeightFormat weight_format(ElemType weights, int64_t accuracy_level) {
  const bool floats = weights == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || weights == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 ||
                      weights == ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16;
  if (floats && accuracy_level == 3 && bf16_compute_available()) return WeightFormat::kBF16Pairs;
  switch (weights) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return WeightFormat::kF16;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return WeightFormat::kBF16;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8:
      return int8_layout() == Int8Layout::kQuads ? WeightFormat::kInt8Quads : WeightFormat::kInt8;
    default: return WeightFormat::kF32;
  }
}

PackedWeights::PackedWeights(WeightFormat format, int64_t N, int64_t K, int64_t slots, bool with_bias,
                             FloatType source)
    : PackedWeights(format, QuantPanels{}, N, K, slot_elements(format, N, K) * static_cast<int64_t>(element_bytes(format)),
                    slots, with_bias, source) {}

PackedWeights::PackedWeights(const QuantPanels& layout, int64_t N, int64_t slots, bool with_bias)
    : PackedWeights(WeightFormat::kQuantized, layout, N, layout.K, panel_count(N) * layout.panel_bytes(), slots,
                    with_bias, FloatType::kF32) {}

PackedWeights::PackedWeights(WeightFormat format, const QuantPanels& layout, int64_t N, int64_t K, int64_t slot_bytes,
                             int64_t slots, bool with_bias, FloatType source)
    : format_(format), source_(source), quant_(layout), N_(N), K_(K), slot_bytes_(slot_bytes) {
  const auto bytes = static_cast<unsigned __int128>(slots) * static_cast<uint64_t>(slot_bytes_);
  try {
    if (bytes > SIZE_MAX) throw std::bad_alloc();
    size_t mapped = 0;
    char* panels = allocate_panels(static_cast<size_t>(bytes), &mapped);
    owned_ = std::unique_ptr<char, PanelsFree>(panels, PanelsFree{mapped});
    panels_ = owned_.get();
  } catch (const std::bad_alloc&) {
    throw AllocationFailure(static_cast<uint64_t>(slots), static_cast<size_t>(slot_bytes_), "packed weights");
  }
  if (with_bias) allocate(bias_, slots * panels() * kPanel, 0.0f, "packed biases");
}

void PanelsFree::operator()(char* p) const {
#if defined(__linux__)
  if (mapped) {
    munmap(p, mapped);
    return;
  }
#endif
  std::free(p);
}

std::string PackedWeights::layout() const {
  static const char* const kNames[] = {"f32", "f16", "bf16", "int8_pairs", "int8_quads", "quantized", "bf16_pairs"};
  std::string s = std::string("format:") + kNames[static_cast<int>(format_)] + ",N:" + std::to_string(N_) +
                  ",K:" + std::to_string(K_) + ",slot_bytes:" + std::to_string(slot_bytes_) +
                  ",bias:" + std::to_string(bias_bytes()) + ",source:" + std::to_string(static_cast<int>(source_));
  if (format_ == WeightFormat::kQuantized)
    s += ",code:" + std::to_string(static_cast<int>(quant_.code)) + ",block:" + std::to_string(quant_.block) +
         ",zero_points:" + std::to_string(quant_.zero_points) + ",int8_activations:" +
         std::to_string(quant_.int8_activations) + ",bf16_prefill:" + std::to_string(quant_.bf16_prefill);
  return s;
}

void PackedWeights::use_packed(const char* panels, const void* biases) {
  owned_.reset();
  panels_ = const_cast<char*>(panels);  // read only: pack is never called on them
  if (!bias_.empty()) std::memcpy(bias_.data(), biases, bias_.size() * sizeof(float));
}

void PackedWeights::pack(int64_t slot, std::initializer_list<ColumnSource> sources) {
  char* dst = panels_ + slot * slot_bytes_;
  const int64_t N = N_, K = K_;
  switch (format_) {
    case WeightFormat::kF32: return place<WeightFormat::kF32, float>(sources, N, K, reinterpret_cast<float*>(dst));
    case WeightFormat::kF16:
      return place<WeightFormat::kF16, uint16_t>(sources, N, K, reinterpret_cast<uint16_t*>(dst));
    case WeightFormat::kBF16:
      return place<WeightFormat::kBF16, uint16_t>(sources, N, K, reinterpret_cast<uint16_t*>(dst));
    case WeightFormat::kInt8:
      return place<WeightFormat::kInt8, int8_t>(sources, N, K, reinterpret_cast<int16_t*>(dst));
    case WeightFormat::kInt8Quads:
      return place<WeightFormat::kInt8Quads, int8_t>(sources, N, K, reinterpret_cast<int8_t*>(dst));
    case WeightFormat::kBF16Pairs:
      return place_bf16_pairs(source_, sources, N, K, reinterpret_cast<uint16_t*>(dst));
    case WeightFormat::kQuantized: throw std::logic_error("internal: quantized panels are packed by pack_quantized");
  }
}

void PackedWeights::pack_quantized(int64_t slot, std::initializer_list<QuantizedColumns> sources) {
  const QuantPanels& q = quant_;
  const int64_t panel_bytes = q.panel_bytes();
  for (int64_t p = 0; p < panels(); ++p) {
    uint8_t* panel = reinterpret_cast<uint8_t*>(panels_ + slot * slot_bytes_) + p * panel_bytes;
    const QuantLanes lanes(q, sources, p);
    const int64_t grouped = lanes.codes_at_bytes ? grouped_rows(q) : 0;
    // zeroed while in cache where not every byte is written: lanes without a column, padding rows, codes
    // placed element by element
    if (!lanes.full || grouped != q.block) std::memset(panel, 0, static_cast<size_t>(panel_bytes));
    place_quant_headers(q, lanes, panel);
    place_quant_codes(q, lanes, grouped, panel);
  }
}

void PackedWeights::multiply(int64_t slot, const float* A, int64_t lda, int64_t M, int64_t p0, int64_t p1, float* C,
                             int64_t ldc) const {
  if (format_ == WeightFormat::kQuantized) return quant_gemm_panels(quant_, A, lda, M, at(slot), p0, p1, C, ldc);
  if (is_int8(format_)) throw std::logic_error("internal: int8 panels multiply prepared int8 rows");
  if (format_ == WeightFormat::kBF16Pairs) throw std::logic_error("internal: bf16 pair panels multiply bf16 rows");
  gemm_panels(panel_type(format_), A, lda, M, K_, at(slot), p0, p1, C, ldc);
}

void PackedWeights::multiply(int64_t slot, const Int8Rows& rows, int64_t M, int64_t p0, int64_t p1, float* C,
                             int64_t ldc) const {
  if (!takes_int8_rows()) throw std::logic_error("internal: quantized rows multiply level-4 panels only");
  quant_gemm_int8_rows(quant_, rows, M, at(slot), p0, p1, C, ldc);
}

void PackedWeights::multiply(int64_t slot, const uint16_t* A, int64_t lda, int64_t M, int64_t p0, int64_t p1, float* C,
                             int64_t ldc) const {
  if (format_ != WeightFormat::kBF16Pairs) throw std::logic_error("internal: bf16 rows multiply bf16 pair panels only");
  bf16_gemm_panels(A, lda, M, K_, at(slot), p0, p1, C, ldc);
}

void PackedWeights::multiply(int64_t slot, const void* A, int64_t lda, int64_t M, int64_t p0, int64_t p1, int32_t* C,
                             int64_t ldc) const {
  if (!is_int8(format_)) throw std::logic_error("internal: prepared int8 rows multiply int8 panels only");
  int8_gemm_panels(A, lda, M, K_, at(slot), p0, p1, C, ldc);
}

void PackedWeights::pack_bias(int64_t slot, ElemType type, const ColumnSource& src) {
  float* dst = bias_.data() + slot * panels() * kPanel;
  const FloatType bias_type = float_type(type);
  for (int64_t c = 0; c < src.columns; ++c)
    dst[(c / src.width) * kPanel + src.lane0 + c % src.width] =
        load_float(bias_type, src.data, src.first + c * src.c_stride);
}

ExpertSlots ExpertSlots::all(int64_t experts) {
  ExpertSlots s;
  allocate(s.slot_of_expert, experts, int64_t{0}, "the expert slot table");
  for (int64_t e = 0; e < experts; ++e) s.slot_of_expert[e] = e;
  s.expert_of_slot = s.slot_of_expert;
  return s;
}

ExpertSlots ExpertSlots::with_rows(const int64_t* offsets, int64_t experts) {
  ExpertSlots s;
  allocate(s.slot_of_expert, experts, int64_t{-1}, "the expert slot table");
  for (int64_t e = 0; e < experts; ++e)
    if (offsets[e + 1] > offsets[e]) {
      s.slot_of_expert[e] = s.count();
      s.expert_of_slot.push_back(e);
    }
  return s;
}

namespace {

// Whether [data, data + bytes) lies in one mapping of a file (/proc/self/maps): onnxruntime's mapping
// of external data.
bool in_file_mapping(const void* data, size_t bytes) {
#if defined(__linux__)
  std::ifstream maps("/proc/self/maps");
  const auto first = reinterpret_cast<uintptr_t>(data), last = first + bytes;
  std::string line;
  while (std::getline(maps, line)) {
    // start-end perms offset dev inode path
    std::istringstream fields(line);
    uintptr_t start = 0, end = 0;
    char dash = 0;
    std::string perms, offset, dev;
    uint64_t inode = 0;
    if (!(fields >> std::hex >> start >> dash >> end >> perms >> offset >> dev >> std::dec >> inode)) continue;
    if (first >= start && first < end) return last <= end && inode != 0;
  }
#endif
  (void)data;
  (void)bytes;
  return false;
}

constexpr uintptr_t kPage = 4096;

// madvise(advice) on the pages of [first, first + bytes): those wholly inside it (inner) or every page
// it touches. A hint: failing costs time only.
void advise_pages(const char* first, size_t bytes, int advice, bool inner) {
#if defined(__linux__)
  const auto start = (reinterpret_cast<uintptr_t>(first) + (inner ? kPage - 1 : 0)) / kPage * kPage;
  const auto end = (reinterpret_cast<uintptr_t>(first) + bytes + (inner ? 0 : kPage - 1)) / kPage * kPage;
  if (end > start) madvise(reinterpret_cast<void*>(start), end - start, advice);
#endif
  (void)first;
  (void)bytes;
  (void)advice;
  (void)inner;
}

}  // namespace

ConstantExperts::ConstantExperts(int64_t experts, const MakeEmpty& make_empty, PackSlot pack_slot,
                                 const std::vector<Input>& weights, const PackedFileRequest& file)
    : experts_(make_empty(ExpertSlots::all(experts))),
      pack_slot_(std::move(pack_slot)),
      packed_(new std::atomic<bool>[static_cast<size_t>(experts)]) {
  for (int64_t e = 0; e < experts; ++e) packed_[e].store(false, std::memory_order_relaxed);
  for (const Input& w : weights) {
    const size_t bytes = static_cast<size_t>(w.count) * elem_size(w.type);
    if (w.present && w.data && in_file_mapping(w.data, bytes))
      mapped_.push_back({static_cast<const char*>(w.data), bytes});
  }
  if (file.path.empty()) return;
  std::vector<PackedFileLayout::Matrix> matrices;
  for (const PackedWeights& m : experts_.matrices)
    matrices.push_back({m.layout(), m.slot_bytes() * experts, m.bias_bytes()});
  const PackedFileLayout layout(matrices, weights, experts);
#if defined(__linux__) && defined(MADV_PAGEOUT)
  for (const MappedWeight& w : mapped_) advise_pages(w.data, w.bytes, MADV_PAGEOUT, false);  // what the fingerprint read
#endif
  if (file.write) write_file(file, layout, make_empty);
  std::string why;
  file_ = MappedPackedFile::open(file.path, layout, &why);
  if (!file_) {
    if (file.write) throw std::runtime_error("the packed-weights file it wrote cannot be used: " + why);
    const std::string message = file.where + ": packs its weights itself: " + why;
    ORT_CXX_LOG_NOEXCEPT(file.logger, ORT_LOGGING_LEVEL_WARNING, message.c_str());
    return;
  }
  for (size_t m = 0; m < experts_.matrices.size(); ++m)
    experts_.matrices[m].use_packed(file_->data() + layout.panel_offsets[m], file_->data() + layout.bias_offsets[m]);
}

void ConstantExperts::advise_mapped_pages(int64_t expert, int advice, bool inner) const {
  const auto experts = static_cast<size_t>(experts_.slots.count());
  for (const MappedWeight& w : mapped_) {
    const size_t per_expert = w.bytes / experts;
    advise_pages(w.data + static_cast<size_t>(expert) * per_expert, per_expert, advice, inner);
  }
}

void ConstantExperts::pack_expert(PackedExperts& into, int64_t slot, int64_t expert) const {
#if defined(__linux__) && defined(MADV_POPULATE_READ)
  advise_mapped_pages(expert, MADV_POPULATE_READ, false);  // one call maps the expert's pages
#endif
  pack_slot_(into, slot);
#if defined(__linux__) && defined(MADV_PAGEOUT)
  // reclaims the clean pages (a later read maps them from the file again); a page onnxruntime had
  // written (copy on write) would only go to swap. Pages shared with the next expert are kept.
  advise_mapped_pages(expert, MADV_PAGEOUT, true);
#endif
}

void ConstantExperts::prepare_expert(int64_t expert) {
  if (!file_) return pack_expert(experts_, expert, expert);
#if defined(__linux__) && defined(MADV_POPULATE_READ)
  for (const PackedWeights& m : experts_.matrices)
    advise_pages(static_cast<const char*>(m.at(expert)), static_cast<size_t>(m.slot_bytes()), MADV_POPULATE_READ, false);
#endif
}

void ConstantExperts::write_file(const PackedFileRequest& file, const PackedFileLayout& layout,
                                 const MakeEmpty& make_empty) const {
  const int64_t experts = experts_.slots.count();
  const int fd = create_packed_file(file.path, layout);
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(
      experts, file.threads > 0 ? file.threads : std::max<int64_t>(1, std::thread::hardware_concurrency()));
  try {
    on_own_threads(threads, [&](int64_t) {  // one expert at a time per thread, through one slot
      try {
        ExpertSlots one;
        one.slot_of_expert.assign(static_cast<size_t>(experts), -1);
        one.expert_of_slot = {0};
        PackedExperts buffer = make_empty(std::move(one));
        for (int64_t e = next++; e < experts; e = next++) {
          buffer.slots.expert_of_slot[0] = e;
          pack_expert(buffer, 0, e);
          for (size_t m = 0; m < buffer.matrices.size(); ++m) {
            const PackedWeights& w = buffer.matrices[m];
            write_packed_bytes(fd, file.path, w.at(0), w.slot_bytes(), layout.panel_offsets[m] + e * w.slot_bytes());
            if (w.bias_bytes() > 0)
              write_packed_bytes(fd, file.path, w.bias_at(0), w.bias_bytes(), layout.bias_offsets[m] + e * w.bias_bytes());
          }
        }
      } catch (...) {
        next = experts;  // the other threads stop too
        throw;
      }
    });
  } catch (const std::exception& x) {
    finish_packed_file(fd, file.path, false);
    throw std::runtime_error(std::string("writing its packed weights: ") + x.what());
  }
  finish_packed_file(fd, file.path, true);
}

const PackedExperts& ConstantExperts::for_run(const Ort::KernelContext& ctx, const int64_t* offsets) {
  const int64_t experts = experts_.slots.count();
  std::vector<int64_t> missing;
  for (int64_t e = 0; e < experts; ++e)
    if (offsets[e + 1] > offsets[e] && !packed_[e].load(std::memory_order_acquire)) missing.push_back(e);
  if (missing.empty()) return experts_;
  std::lock_guard<std::mutex> lock(packing_);  // one run packs; a concurrent run waits, then finds them packed
  missing.erase(std::remove_if(missing.begin(), missing.end(),
                               [&](int64_t e) { return packed_[e].load(std::memory_order_acquire); }),
                missing.end());
  parallel_for(ctx, missing.size(), [&](size_t i) { prepare_expert(missing[i]); });
  for (int64_t e : missing) packed_[e].store(true, std::memory_order_release);
  return experts_;
}

}  // namespace moe_onnx
