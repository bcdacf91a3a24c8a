# Cross-compiling the libraries for aarch64 Linux on another machine (docs/building.md, "aarch64"):
#   cmake -S custom_ops -B build/arm64 -DCMAKE_TOOLCHAIN_FILE=custom_ops/cmake/aarch64-linux-gnu.cmake ...
# with Debian's g++-aarch64-linux-gnu (scripts/install_arm64_tools.sh installs it and qemu-user-static).
# The aarch64 programs the build makes run here under qemu (CMAKE_CROSSCOMPILING_EMULATOR).
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(MOE_ONNX_ARM64_PREFIX aarch64-linux-gnu CACHE STRING "the cross toolchain's prefix")
set(CMAKE_C_COMPILER ${MOE_ONNX_ARM64_PREFIX}-gcc)
set(CMAKE_CXX_COMPILER ${MOE_ONNX_ARM64_PREFIX}-g++)
set(MOE_ONNX_ARM64_SYSROOT /usr/${MOE_ONNX_ARM64_PREFIX} CACHE PATH "the aarch64 C library's root")
set(CMAKE_FIND_ROOT_PATH ${MOE_ONNX_ARM64_SYSROOT})
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64-static -L ${MOE_ONNX_ARM64_SYSROOT})
