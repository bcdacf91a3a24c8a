# Finds onnxruntime's C/C++ headers (onnxruntime_cxx_api.h), in this order:
#   1. MOE_ONNX_ORT_INCLUDE_DIR (CMake variable, or the environment variable of the same name);
#   2. system headers (find_path in the usual prefixes, including include/onnxruntime);
#   3. on Debian-family machines, the libonnxruntime-dev package of a newer Debian release
#      (MOE_ONNX_ORT_DEBIAN_SUITE, default trixie), downloaded with a private apt configuration
#      from the machine's own mirror and extracted into the build tree, never installed
#      (cmake/debian_ort_headers.sh; MOE_ONNX_ORT_FROM_DEBIAN=OFF skips it);
#   4. the ONNX Runtime release archive of MOE_ONNX_ORT_VERSION, downloaded into the build tree
#      (MOE_ONNX_ORT_FROM_RELEASE=OFF skips it).
# The library built on headers of version V loads into every onnxruntime >= V (ORT_API_MANUAL_INIT).
set(MOE_ONNX_ORT_INCLUDE_DIR "$ENV{MOE_ONNX_ORT_INCLUDE_DIR}" CACHE PATH "onnxruntime include dir (holds onnxruntime_cxx_api.h)")
option(MOE_ONNX_ORT_FROM_DEBIAN "Fetch the headers from a newer Debian release's libonnxruntime-dev" ON)
set(MOE_ONNX_ORT_DEBIAN_SUITE "trixie" CACHE STRING "Debian suite to take libonnxruntime-dev from")
option(MOE_ONNX_ORT_FROM_RELEASE "Download the ONNX Runtime release archive for its headers" ON)
set(MOE_ONNX_ORT_VERSION "1.21.0" CACHE STRING "ONNX Runtime release whose headers are downloaded")

function(_moe_onnx_release_archive out_var)
  set(v ${MOE_ONNX_ORT_VERSION})
  if(WIN32)
    set(name onnxruntime-win-x64-${v})
    set(ext zip)
  elseif(APPLE)
    set(name onnxruntime-osx-universal2-${v})
    set(ext tgz)
  elseif(CMAKE_SYSTEM_PROCESSOR MATCHES "aarch64|arm64")
    set(name onnxruntime-linux-aarch64-${v})
    set(ext tgz)
  else()
    set(name onnxruntime-linux-x64-${v})
    set(ext tgz)
  endif()
  set(url "https://github.com/microsoft/onnxruntime/releases/download/v${v}/${name}.${ext}")
  set(dir ${CMAKE_BINARY_DIR}/_deps/ort-release)
  if(NOT EXISTS ${dir}/${name}/include/onnxruntime_cxx_api.h)
    message(STATUS "moe_onnx: downloading ${url}")
    file(DOWNLOAD ${url} ${dir}/${name}.${ext} STATUS status TLS_VERIFY ON)
    list(GET status 0 code)
    if(NOT code EQUAL 0)
      list(GET status 1 msg)
      message(STATUS "moe_onnx: download failed: ${msg}")
      set(${out_var} "" PARENT_SCOPE)
      return()
    endif()
    file(ARCHIVE_EXTRACT INPUT ${dir}/${name}.${ext} DESTINATION ${dir} PATTERNS "${name}/include/*")
  endif()
  set(${out_var} ${dir}/${name}/include PARENT_SCOPE)
endfunction()

function(moe_onnx_find_ort_headers out_var)
  # 1. explicit override
  if(MOE_ONNX_ORT_INCLUDE_DIR)
    if(NOT EXISTS "${MOE_ONNX_ORT_INCLUDE_DIR}/onnxruntime_cxx_api.h")
      message(FATAL_ERROR "MOE_ONNX_ORT_INCLUDE_DIR=${MOE_ONNX_ORT_INCLUDE_DIR} has no onnxruntime_cxx_api.h")
    endif()
    set(${out_var} ${MOE_ONNX_ORT_INCLUDE_DIR} PARENT_SCOPE)
    return()
  endif()
  # 2. system headers
  find_path(MOE_ONNX_ORT_SYSTEM_INCLUDE onnxruntime_cxx_api.h
            PATH_SUFFIXES onnxruntime onnxruntime/core/session include/onnxruntime)
  if(MOE_ONNX_ORT_SYSTEM_INCLUDE)
    set(${out_var} ${MOE_ONNX_ORT_SYSTEM_INCLUDE} PARENT_SCOPE)
    return()
  endif()
  # 3. a newer Debian release's libonnxruntime-dev, extracted into the build tree
  find_program(MOE_ONNX_APT_GET apt-get)
  find_program(MOE_ONNX_DPKG dpkg)
  if(MOE_ONNX_ORT_FROM_DEBIAN AND MOE_ONNX_APT_GET AND MOE_ONNX_DPKG)
    set(dest ${CMAKE_BINARY_DIR}/_deps/ort-debian)
    file(GLOB_RECURSE found ${dest}/root/*/onnxruntime_cxx_api.h)
    if(NOT found)
      message(STATUS "moe_onnx: fetching libonnxruntime-dev from Debian ${MOE_ONNX_ORT_DEBIAN_SUITE} (not installed)")
      execute_process(
        COMMAND sh ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/debian_ort_headers.sh ${dest} ${MOE_ONNX_ORT_DEBIAN_SUITE}
        RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err OUTPUT_STRIP_TRAILING_WHITESPACE)
      if(NOT rc EQUAL 0)
        message(STATUS "moe_onnx: Debian headers not available (${rc}): ${err}")
      endif()
      file(GLOB_RECURSE found ${dest}/root/*/onnxruntime_cxx_api.h)
    endif()
    if(found)
      list(GET found 0 header)
      get_filename_component(dir ${header} DIRECTORY)
      set(${out_var} ${dir} PARENT_SCOPE)
      return()
    endif()
  endif()
  # 4. the release archive
  if(MOE_ONNX_ORT_FROM_RELEASE)
    _moe_onnx_release_archive(dir)
    if(dir AND EXISTS ${dir}/onnxruntime_cxx_api.h)
      set(${out_var} ${dir} PARENT_SCOPE)
      return()
    endif()
  endif()
  message(FATAL_ERROR "moe_onnx: onnxruntime headers (onnxruntime_cxx_api.h) not found. Set "
                      "MOE_ONNX_ORT_INCLUDE_DIR (CMake variable or environment variable) to their directory.")
endfunction()
