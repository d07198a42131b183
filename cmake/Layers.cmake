# The library's layers and their public headers: the one list of which header in
# include/pipewright/ belongs to which layer (docs/architecture.md, "Layers").
#
# A layer may include its own headers and those of the layers it sits on (_BELOW: the whole set,
# not only the next layer down), never a header of a layer above or beside it. For each layer,
# configure stages exactly those headers, as links to include/pipewright/, into
# build/layers/<layer>/include/pipewright/, and puts there, for every other public header, a stub
# that stops the compile with an #error naming the header's layer. The target
# pipewright_layer_<layer> has that directory and Abseil as its only include paths, and:
#   - the layer's own library (pipewright_io, _schedules, _partitioner, _kernels_cpu) compiles its
#     sources with it instead of include/ (pw_layer_library), so a source that includes a header
#     of a higher layer does not build;
#   - tests/headers compiles every public header alone with its layer's target, so a header that
#     reaches, even through another header, one of a higher layer does not build.
# A header added to include/pipewright/ must be listed here: configure fails otherwise.
set(PIPEWRIGHT_LAYERS base io schedules partitioner kernels runtime)

# base: Status helpers (PW_RETURN_IF_ERROR, ...) and what the host offers (UsableCores), used by
# every layer.
set(PIPEWRIGHT_LAYER_base_HEADERS status.h host.h)
set(PIPEWRIGHT_LAYER_base_BELOW)
# io: bounded input (io/, pipewright_io).
set(PIPEWRIGHT_LAYER_io_HEADERS input.h)
set(PIPEWRIGHT_LAYER_io_BELOW base)
# schedules: action IR, generators, validator, simulator (schedules/, pipewright_schedules).
set(PIPEWRIGHT_LAYER_schedules_HEADERS schedule.h simulator.h)
set(PIPEWRIGHT_LAYER_schedules_BELOW base)
# partitioner: costs, plans, memory model, partition search (partitioner/, pipewright_partitioner).
set(PIPEWRIGHT_LAYER_partitioner_HEADERS cost.h precision_kind.h plan.h partitioner.h)
set(PIPEWRIGHT_LAYER_partitioner_BELOW base io schedules)
# kernels: the CPU the kernels run on (kernels/cpu/, pipewright_kernels_cpu).
set(PIPEWRIGHT_LAYER_kernels_HEADERS cpu.h)
set(PIPEWRIGHT_LAYER_kernels_BELOW base)
# runtime: devices, tensors, layers, models, ops, communicators, the engine, training.
set(PIPEWRIGHT_LAYER_runtime_HEADERS
  device.h tensor.h layer.h init.h ops.h model.h precision.h optimizer.h data.h checkpoint.h
  comm.h tensor_parallel.h launch.h run_spec.h train.h train_testing.h run_memory.h engine.h
  trace.h)
set(PIPEWRIGHT_LAYER_runtime_BELOW base io schedules partitioner kernels)

# Every public header is in exactly one layer, and every listed header exists.
file(GLOB _pw_public RELATIVE ${PROJECT_SOURCE_DIR}/include/pipewright
     CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/include/pipewright/*.h)
set(_pw_listed)
foreach(_layer IN LISTS PIPEWRIGHT_LAYERS)
  foreach(_h IN LISTS PIPEWRIGHT_LAYER_${_layer}_HEADERS)
    if(_h IN_LIST _pw_listed)
      message(FATAL_ERROR "cmake/Layers.cmake: pipewright/${_h} is listed in two layers")
    endif()
    if(NOT _h IN_LIST _pw_public)
      message(FATAL_ERROR "cmake/Layers.cmake: layer ${_layer} lists pipewright/${_h}, which "
                          "is not in include/pipewright/")
    endif()
    list(APPEND _pw_listed ${_h})
    set(_pw_layer_of_${_h} ${_layer})
  endforeach()
endforeach()
foreach(_h IN LISTS _pw_public)
  if(NOT _h IN_LIST _pw_listed)
    message(FATAL_ERROR "cmake/Layers.cmake: include/pipewright/${_h} belongs to no layer: add "
                        "it to the PIPEWRIGHT_LAYER_<layer>_HEADERS list of its layer")
  endif()
endforeach()

# Stages each layer's headers and creates pipewright_layer_<layer>.
foreach(_layer IN LISTS PIPEWRIGHT_LAYERS)
  set(_dir ${CMAKE_BINARY_DIR}/layers/${_layer}/include)
  file(REMOVE_RECURSE ${_dir})
  file(MAKE_DIRECTORY ${_dir}/pipewright)
  set(_allowed)
  foreach(_l IN ITEMS ${_layer} LISTS PIPEWRIGHT_LAYER_${_layer}_BELOW)
    list(APPEND _allowed ${PIPEWRIGHT_LAYER_${_l}_HEADERS})
  endforeach()
  foreach(_h IN LISTS _pw_public)
    if(_h IN_LIST _allowed)
      file(CREATE_LINK ${PROJECT_SOURCE_DIR}/include/pipewright/${_h} ${_dir}/pipewright/${_h}
           SYMBOLIC)
    else()
      string(JOIN " " _allowed_text ${_allowed})
      file(WRITE ${_dir}/pipewright/${_h}
           "#error \"pipewright/${_h} belongs to the ${_pw_layer_of_${_h}} layer: the ${_layer} "
           "layer may include only ${_allowed_text} (cmake/Layers.cmake, docs/architecture.md)\"\n")
    endif()
  endforeach()
  add_library(pipewright_layer_${_layer} INTERFACE)
  target_include_directories(pipewright_layer_${_layer} INTERFACE ${_dir})
  target_link_libraries(pipewright_layer_${_layer} INTERFACE absl::status absl::statusor
                        absl::strings absl::str_format absl::time absl::synchronization)
endforeach()

# pw_layer_library(TARGET LAYER [SOURCE_DIR dir]): TARGET compiles with LAYER's headers only
# (and with the private headers of SOURCE_DIR, a folder of the source tree, included as
# "<folder>/x.h"); its users still see include/ through pipewright_headers.
function(pw_layer_library target layer)
  cmake_parse_arguments(PARSE_ARGV 2 arg "" "SOURCE_DIR" "")
  if(arg_SOURCE_DIR)
    get_filename_component(_name ${arg_SOURCE_DIR} NAME)
    get_filename_component(_parent ${arg_SOURCE_DIR} DIRECTORY)
    file(RELATIVE_PATH _rel ${PROJECT_SOURCE_DIR} ${_parent})
    set(_dir ${CMAKE_BINARY_DIR}/layers/${layer}/private)
    file(MAKE_DIRECTORY ${_dir}/${_rel})
    file(CREATE_LINK ${arg_SOURCE_DIR} ${_dir}/${_rel}/${_name} SYMBOLIC)
    target_include_directories(${target} PRIVATE ${_dir})
  endif()
  target_link_libraries(${target} PRIVATE $<BUILD_INTERFACE:pipewright_layer_${layer}>
                        INTERFACE pipewright_headers)
endfunction()
