// Placement of QMOE's quantized panels (panel_layout.h; their layout: qgemm.h): per panel, its blocks'
// headers (int: scales widened to fp32, zero points; E2M1: the E8M0 scale bytes as stored) and code
// groups. The 16 lanes' code groups go through the ISA table's quant_code_groups, and the headers 16
// blocks at a time through transpose_tile, where every lane has a column whose codes start at a byte;
// the rest element by element.
#include <cstring>

#include "float_rows.h"
#include "isa.h"
#include "panel_layout.h"

namespace moe_onnx {
namespace {

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

  // Block b's scale of a lane (with a column) of int codes, as fp32.
  float scale(int64_t lane, int64_t b) const { return load_float(scale_type[lane], source[lane]->scales, scales[lane] + b); }
  // Block b's E8M0 scale of a lane (with a column) of E2M1 codes.
  uint8_t e8m0_scale(int64_t lane, int64_t b) const {
    return static_cast<const uint8_t*>(source[lane]->scales)[scales[lane] + b];
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
        if (q.code == QuantCode::kE2M1 || scale_bytes == 4) {  // E8M0 bytes or fp32 scales as they are
          std::memcpy(header, row, kPanel * scale_bytes);
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
      if (q.code == QuantCode::kE2M1) {
        header[lane] = lanes.e8m0_scale(lane, b);
        continue;
      }
      const float scale = lanes.scale(lane, b);
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

void place_quantized_panels(const QuantPanels& q, std::initializer_list<QuantizedColumns> sources, int64_t panels,
                            uint8_t* dst) {
  const int64_t panel_bytes = q.panel_bytes();
  for (int64_t p = 0; p < panels; ++p) {
    uint8_t* panel = dst + p * panel_bytes;
    const QuantLanes lanes(q, sources, p);
    const int64_t grouped = lanes.codes_at_bytes ? grouped_rows(q) : 0;
    // zeroed while in cache where not every byte is written: lanes without a column, padding rows, codes
    // placed element by element
    if (!lanes.full || grouped != q.block) std::memset(panel, 0, static_cast<size_t>(panel_bytes));
    place_quant_headers(q, lanes, panel);
    place_quant_codes(q, lanes, grouped, panel);
  }
}

}  // namespace moe_onnx
