// The expert block MOE and QMOE share: the expert type and activation from their common
// attributes, the indices' range check, and steps 2-5 of a Compute (route, gate/up with the
// activation, down, sum over the slots: moe.cc's header describes them) on packed experts whose
// matrices are float or quantized panels (PackedWeights::multiply).
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "activation.h"
#include "checker.h"
#include "comm.h"
#include "constant_experts.h"
#include "op_signatures.h"
#include "packed_weights.h"
#include "task_plan.h"
#include "workspace.h"

namespace moe_onnx {

class Attributes;

// The expert type (ExpertType: the `expert_type` attribute's values, op_choices.h) and its activation
// (MOE's expert_type, expert_alpha, expert_beta, gate_parity, activation attributes; QMOE has the
// same ones).
struct ExpertConfig {
  ExpertType type = ExpertType::kGemm2BiasSwigluClamp;
  GatedActivation activation;     // of the SwiGLU types, with expert_alpha (and expert_beta: the clamp limit)
  PointwiseActivation pointwise;  // of GEMM2_ACT
  int64_t parity = 0;

  // The attributes after moe.py's checks, in its order and words.
  static ExpertConfig read(const Attributes& attrs);
  // Whether the first GEMM's panels are gate/up panels (8 gate, 8 up columns), not plain ones.
  bool gated() const { return type != ExpertType::kGemm2Act; }
};

constexpr int64_t kHalfPanel = kPanel / 2;  // gate (or up) columns per gate/up panel
enum { GATE_UP, DOWN };                      // the packed matrices of an expert

struct MoeDims {
  int64_t T, k, E, H, I;
};

// The token inputs' checks of moe.py's validate_tokens, in its order and words: the type of
// hidden_states (input 0), `same_type` (inputs given must have it), indices (input 2); then the shapes of
// hidden_states [*, H], routing_weights (input 1) and indices [*, k] with T rows, bound in `dims`.
// Returns hidden_states' type.
ElemType validate_tokens(const Checker& v, std::initializer_list<int> same_type, DimBinder& dims);

// Every index in [0, E), else moe.py's message.
void check_indices(const Input& indices, int64_t E, const std::string& where);

// The workspaces of the runs' buffers, O(T*k*max(H, 2I)): gathered rows, activations, weighted expert
// outputs, a TP rank's float32 sums. Shared by every MOE and QMOE node of the process (a model's layers
// run one after the other: one workspace serves them all, rather than one per layer, each as large as
// the longest prompt's); a run leases one (a run that finds none idle gets a new one, as concurrent runs
// do), so a run in steady state neither allocates nor page-faults them. Two idle ones are kept.
WorkspacePool& run_workspaces();

// How MOE or QMOE packs its experts from the node's inputs: room for the experts of `slots` (the gate/up
// and down matrices of sizes H and I, not yet packed), and the packing of one slot.
struct ExpertPacker {
  std::function<PackedExperts(const std::vector<Input>& inputs, int64_t H, int64_t I, ExpertSlots slots)> empty;
  std::function<void(const std::vector<Input>& inputs, PackedExperts& p, int64_t slot)> pack;
};

// The expert cache of a MOE or QMOE node (constant_experts.h) when every one of its weight inputs
// (`weights`: their indices) is an initializer that passes check_weights (Compute's checks of them, which
// bind E, H and I; a failed check leaves the error to Compute, which reports it in the reference's order)
// and the matrices have elements (H, I > 0: the pack is then in proportion to the weights' data, whatever
// E is); else null, and each run packs the experts it uses.
std::unique_ptr<ConstantExperts> constant_experts(const Ort::ConstKernelInfo& kinfo, const OpSignature& op,
                                                  const std::string& where, const std::vector<int>& weights,
                                                  const std::function<void(const Checker&, DimBinder&)>& check_weights,
                                                  const ExpertPacker& packer, const PackedWeightsFiles* files);

// Where a run's packed experts come from: the node's cache (null: none), else packed for the run from
// the node's inputs.
struct ExpertWeights {
  ConstantExperts* cache;
  const ExpertPacker& packer;
  const std::vector<Input>& inputs;
};

// A node's tensor-parallel group (docs/distributed.md), null on one process: each rank's partial y
// (float32; the down bias only on TP rank 0) is summed over it and rounded once. `where` names the
// node in the collective's errors.
struct TensorParallel {
  const comm::Group* group = nullptr;
  const char* where = "";
};

// Steps 2-5 of a Compute on checked inputs: writes y (hidden_states' shape and type) to `out`.
// `down_bias`: whether the down linear has a bias (with I == 0 it alone reaches the output).
void run_experts(Ort::KernelContext& ctx, const ExpertConfig& config, const MoeDims& d, const Input& hidden,
                 const Input& routing, const Input& indices, bool down_bias, const ExpertWeights& experts,
                 char* out, const TensorParallel& tp = {});

}  // namespace moe_onnx
