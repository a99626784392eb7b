# One CMake library per pipeline stage (a folder of src/), linked along the arrows of docs/architecture.md.
#
# A stage sees exactly the headers of the stages it links, transitively: its include directory is a folder of
# symbolic links under build/stages/<target>/ holding its own public headers (include/dcp/<name>.h, listed by
# the stage) and its own folder's private headers (src/<folder>/*.h, not those of subfolders, which are stages
# of their own). target_link_libraries propagates these directories up the arrows and never down, so an include
# that points the wrong way (a lower stage including a higher one's header) fails to compile with "No such file
# or directory", and a call that points the wrong way fails to link in the programs that link the lower stage
# alone (the tests). Includes are written from the root ("dcp/x.h", "stage/x.h"): scripts/check_includes.cmake
# refuses a relative include, which the compiler would find beside the including file whatever the arrows.

set(DCP_STAGE_DIR ${CMAKE_BINARY_DIR}/stages)

# dcp_stage(<target> FOLDER <folder under src/> [INTERFACE] [TORCH_FREE] [HEADERS <include/dcp names>...]
#           [LINKS <targets>...])
function(dcp_stage target)
  cmake_parse_arguments(S "INTERFACE;TORCH_FREE" "FOLDER" "HEADERS;LINKS" ${ARGN})
  set(root ${DCP_STAGE_DIR}/${target})
  file(REMOVE_RECURSE ${root})
  file(MAKE_DIRECTORY ${root}/dcp ${root}/${S_FOLDER})
  foreach(h IN LISTS S_HEADERS)
    if(NOT EXISTS ${PROJECT_SOURCE_DIR}/include/dcp/${h})
      message(FATAL_ERROR "stage ${target}: include/dcp/${h} does not exist")
    endif()
    file(CREATE_LINK ${PROJECT_SOURCE_DIR}/include/dcp/${h} ${root}/dcp/${h} SYMBOLIC)
  endforeach()
  file(GLOB private_headers CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/src/${S_FOLDER}/*.h)
  foreach(h IN LISTS private_headers)
    get_filename_component(name ${h} NAME)
    file(CREATE_LINK ${h} ${root}/${S_FOLDER}/${name} SYMBOLIC)
  endforeach()
  if(S_INTERFACE)
    add_library(${target} INTERFACE)
    target_include_directories(${target} INTERFACE ${root})
    target_link_libraries(${target} INTERFACE ${S_LINKS})
  else()
    file(GLOB sources CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/src/${S_FOLDER}/*.cpp)
    add_library(${target} STATIC ${sources})
    target_include_directories(${target} PUBLIC ${root})
    target_link_libraries(${target} PUBLIC ${S_LINKS})
    if(NOT S_TORCH_FREE)
      if(TARGET dcp_pch)
        target_precompile_headers(${target} REUSE_FROM dcp_pch)
      endif()
    endif()
  endif()
  if(NOT S_INTERFACE AND TARGET dcp_check_includes)
    add_dependencies(${target} dcp_check_includes)
  endif()
endfunction()
