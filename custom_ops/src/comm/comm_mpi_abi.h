// The C interface between libmoe_onnx_ops (comm.cc) and libmoe_onnx_mpi (comm_mpi.cc): one table of
// functions, found with dlsym("moe_onnx_mpi_table"). Plain C types only, so the two libraries need
// not agree on anything else; no exception crosses it: a call returns a status and, unless it is
// MOE_ONNX_MPI_OK, a message in `error` (MOE_ONNX_MPI_ERROR_SIZE bytes, NUL-terminated).
#pragma once

#include <stddef.h>
#include <stdint.h>

extern "C" {

enum { MOE_ONNX_MPI_ABI_VERSION = 2, MOE_ONNX_MPI_ERROR_SIZE = 512 };

enum MoeOnnxMpiStatus {
  MOE_ONNX_MPI_OK = 0,
  MOE_ONNX_MPI_TIMEOUT = 1,  // the call did not complete within its timeout; its communicator is unusable
  MOE_ONNX_MPI_ERROR = 2,    // `error` says why
};

enum MoeOnnxMpiElement { MOE_ONNX_MPI_FLOAT32 = 0, MOE_ONNX_MPI_INT32 = 1 };

// A communicator of libmoe_onnx_mpi (never freed: groups live as long as the process).
typedef struct MoeOnnxMpiComm MoeOnnxMpiComm;
// An all-to-all-v whose buffers belong to libmoe_onnx_mpi: the caller writes what it sends into them and
// reads what arrived from them, so no copy is made on either side.
typedef struct MoeOnnxMpiAllToAll MoeOnnxMpiAllToAll;

// Every count is in bytes unless it says elements; `timeout_s` bounds the wait of one call.
struct MoeOnnxMpiTable {
  int abi_version;
  // Initializes MPI unless someone already has (then finalizes it at exit), and gives the size of
  // MPI_COMM_WORLD and this process's rank in it.
  int (*world)(int64_t* size, int64_t* rank, char* error);
  // The communicator of the world's ranks with this `color`, ordered by `key` (a collective of the
  // whole world, as MPI_Comm_split).
  int (*split)(int64_t color, int64_t key, double timeout_s, MoeOnnxMpiComm** comm, char* error);
  // In place: data[0 .. count) (elements of `element`) = its sum over the communicator.
  int (*all_reduce_sum)(MoeOnnxMpiComm* comm, void* data, int64_t count, int element, double timeout_s,
                        char* error);
  // An all-to-all-v on `comm` with a send buffer of send_size bytes and a receive buffer of recv_size
  // (not zero-filled), valid until close_all_to_all_v.
  int (*open_all_to_all_v)(MoeOnnxMpiComm* comm, int64_t send_size, int64_t recv_size,
                           MoeOnnxMpiAllToAll** exchange, void** send, void** recv, char* error);
  // Runs it: send_bytes[r] bytes of the send buffer (consecutive, rank order) go to rank r; recv_bytes[r]
  // arrive from it (consecutive, rank order). After a timeout MPI keeps the buffers.
  int (*run_all_to_all_v)(MoeOnnxMpiAllToAll* exchange, const int64_t* send_bytes, const int64_t* recv_bytes,
                          double timeout_s, char* error);
  // Gives its buffers back for the next exchange (unless a run timed out: they stay MPI's).
  void (*close_all_to_all_v)(MoeOnnxMpiAllToAll* exchange);
  // recv = every rank's send concatenated in rank order, recv_bytes[r] from rank r.
  int (*all_gather_v)(MoeOnnxMpiComm* comm, const void* send, int64_t send_bytes, void* recv,
                      const int64_t* recv_bytes, double timeout_s, char* error);
  // send: the float32 blocks of every rank (counts[r] elements for rank r, rank order); recv: the sum
  // over the communicator of this rank's block.
  int (*reduce_scatter_v_sum)(MoeOnnxMpiComm* comm, const float* send, float* recv, const int64_t* counts,
                              double timeout_s, char* error);
};

// The table of libmoe_onnx_mpi (exported; everything else is hidden).
typedef const MoeOnnxMpiTable* (*MoeOnnxMpiTableFunction)(void);

}  // extern "C"
