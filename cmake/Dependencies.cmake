# Third-party dependencies, all from Debian packages (scripts/setup installs them).
find_package(Threads REQUIRED)
find_package(absl REQUIRED)
find_package(nlohmann_json 3 REQUIRED)
find_package(CLI11 CONFIG REQUIRED)
set(BLA_VENDOR OpenBLAS)
find_package(BLAS REQUIRED)
find_path(PIPEWRIGHT_CBLAS_INCLUDE cblas.h PATH_SUFFIXES openblas openblas-pthread
          PATHS /usr/include/x86_64-linux-gnu /usr/include/aarch64-linux-gnu)
if(NOT PIPEWRIGHT_CBLAS_INCLUDE)
  message(FATAL_ERROR "cblas.h not found: install libopenblas-dev (scripts/setup)")
endif()
add_library(pipewright_blas INTERFACE)
target_include_directories(pipewright_blas INTERFACE ${PIPEWRIGHT_CBLAS_INCLUDE})
target_link_libraries(pipewright_blas INTERFACE ${BLAS_LIBRARIES})

# SentencePiece (`pipewright data train-tokenizer`, `prepare --tokenizer spm:`; runtime/tokenizer.cc):
# libsentencepiece-dev ships a pkg-config file but no CMake package, so the headers and both
# libraries are found by name (pkg-config's `sentencepiece` names the same two). Like
# pipewright_blas, an INTERFACE target holding absolute paths, exported with the library.
find_path(PIPEWRIGHT_SENTENCEPIECE_INCLUDE sentencepiece_processor.h)
find_library(PIPEWRIGHT_SENTENCEPIECE_LIBRARY sentencepiece)
find_library(PIPEWRIGHT_SENTENCEPIECE_TRAIN_LIBRARY sentencepiece_train)
if(NOT PIPEWRIGHT_SENTENCEPIECE_INCLUDE OR NOT PIPEWRIGHT_SENTENCEPIECE_LIBRARY
   OR NOT PIPEWRIGHT_SENTENCEPIECE_TRAIN_LIBRARY)
  message(FATAL_ERROR "SentencePiece not found (sentencepiece_processor.h, libsentencepiece, "
                      "libsentencepiece_train): install libsentencepiece-dev (scripts/setup)")
endif()
add_library(pipewright_sentencepiece INTERFACE)
target_include_directories(pipewright_sentencepiece INTERFACE ${PIPEWRIGHT_SENTENCEPIECE_INCLUDE})
target_link_libraries(pipewright_sentencepiece INTERFACE ${PIPEWRIGHT_SENTENCEPIECE_TRAIN_LIBRARY}
                      ${PIPEWRIGHT_SENTENCEPIECE_LIBRARY})

if(PIPEWRIGHT_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
find_package(benchmark QUIET)

# ---- MPI: the mpi communicator backend (runtime/comm/mpi.cc) when an MPI C library is found ----
set(PIPEWRIGHT_MPI AUTO CACHE STRING "Build the MPI backend: AUTO (when MPI is found), ON, OFF")
set_property(CACHE PIPEWRIGHT_MPI PROPERTY STRINGS AUTO ON OFF)
set(PIPEWRIGHT_WITH_MPI OFF)
if(NOT PIPEWRIGHT_MPI STREQUAL "OFF")
  find_package(MPI COMPONENTS C)
  if(MPI_C_FOUND)
    set(PIPEWRIGHT_WITH_MPI ON)
  elseif(PIPEWRIGHT_MPI STREQUAL "ON")
    message(FATAL_ERROR "PIPEWRIGHT_MPI=ON but no MPI C library was found (install libopenmpi-dev)")
  endif()
endif()
message(STATUS "pipewright: MPI backend ${PIPEWRIGHT_WITH_MPI}")

# ---- CUDA: AUTO turns it on when nvcc is found ----
set(PIPEWRIGHT_WITH_CUDA OFF)
set(PIPEWRIGHT_WITH_NCCL OFF)
if(NOT PIPEWRIGHT_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 90)
    endif()
    # One cudart per process: the shared library, the same one CUDA::cudart names (the default,
    # cudart_static, would put a second copy of the runtime's state next to it).
    set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
    enable_language(CUDA)
    # CMake 3.25 does not know nvcc's C++20 flag.
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION -std=c++20)
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION -std=c++20)
    set(CMAKE_CUDA_STANDARD 20)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    find_package(CUDAToolkit REQUIRED)
    set(PIPEWRIGHT_WITH_CUDA ON)
    # NCCL ships without a CMake package: look for it next to the toolkit (and in the usual
    # system places, where the Debian/NVIDIA packages put it).
    find_path(PIPEWRIGHT_NCCL_INCLUDE nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS}
              PATHS /usr/local/cuda/include /usr/include)
    find_library(PIPEWRIGHT_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR}
                 PATHS /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu)
    if(PIPEWRIGHT_NCCL_INCLUDE AND PIPEWRIGHT_NCCL_LIBRARY)
      set(PIPEWRIGHT_WITH_NCCL ON)
      add_library(pipewright_nccl INTERFACE)
      target_include_directories(pipewright_nccl INTERFACE ${PIPEWRIGHT_NCCL_INCLUDE})
      target_link_libraries(pipewright_nccl INTERFACE ${PIPEWRIGHT_NCCL_LIBRARY})
    else()
      set(PIPEWRIGHT_WITH_NCCL OFF)
      message(WARNING "pipewright: nccl.h/libnccl not found; the NCCL communicator is not built")
    endif()
  elseif(PIPEWRIGHT_CUDA STREQUAL "ON")
    message(FATAL_ERROR "PIPEWRIGHT_CUDA=ON but no CUDA compiler (nvcc) was found")
  endif()
endif()
message(STATUS "pipewright: CUDA backend ${PIPEWRIGHT_WITH_CUDA}, NCCL ${PIPEWRIGHT_WITH_NCCL}")
