# Small functions that keep each folder's CMakeLists.txt to a few declarative lines.
include_guard(GLOBAL)

function(ucp_add_subdirectory_if_present dir)
  if(EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/${dir}/CMakeLists.txt)
    add_subdirectory(${dir})
  endif()
endfunction()

# Warnings for our own targets only; third-party headers come in as SYSTEM.
function(ucp_set_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wno-missing-field-initializers>)
  if(UCP_WERROR)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Werror>)
  endif()
  if(UCP_SANITIZE)
    target_compile_options(${target} PRIVATE -fsanitize=${UCP_SANITIZE} -fno-omit-frame-pointer)
    target_link_options(${target} PRIVATE -fsanitize=${UCP_SANITIZE})
  endif()
endfunction()

# ucp_add_library(NAME ucp_tensor SRCS a.cc b.cc DEPS ucp_base [PRIVATE_DEPS ...])
# Defines ucp_<x> with the alias ucp::<x>; the include root is libucp/ so code writes "ucp/...".
function(ucp_add_library)
  cmake_parse_arguments(A "" "NAME" "SRCS;DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(${A_NAME} ${A_SRCS})
  string(REGEX REPLACE "^ucp_" "" short ${A_NAME})
  add_library(ucp::${short} ALIAS ${A_NAME})
  target_include_directories(${A_NAME} PUBLIC
    $<BUILD_INTERFACE:${UCP_SOURCE_ROOT}/libucp>
    $<BUILD_INTERFACE:${UCP_SOURCE_ROOT}/offload>
    $<INSTALL_INTERFACE:include>)
  target_link_libraries(${A_NAME} PUBLIC ${A_DEPS} PRIVATE ${A_PRIVATE_DEPS})
  target_compile_features(${A_NAME} PUBLIC cxx_std_20)
  set_target_properties(${A_NAME} PROPERTIES EXPORT_NAME ${short})
  ucp_set_warnings(${A_NAME})
  set_property(GLOBAL APPEND PROPERTY UCP_INSTALL_TARGETS ${A_NAME})
endfunction()

# ucp_add_test(NAME dtype_test SRCS dtype_test.cc DEPS ucp_tensor [LABELS unit] [TIMEOUT s])
# One gtest binary, registered with ctest as a single test so the suite stays quick to list.
function(ucp_add_test)
  cmake_parse_arguments(A "" "NAME;TIMEOUT" "SRCS;DEPS;LABELS" ${ARGN})
  if(NOT UCP_BUILD_TESTS)
    return()
  endif()
  add_executable(${A_NAME} ${A_SRCS})
  target_link_libraries(${A_NAME} PRIVATE ${A_DEPS} ucp_testutil GTest::gtest GTest::gmock
                                          GTest::gtest_main)
  ucp_set_warnings(${A_NAME})
  if(NOT A_LABELS)
    set(A_LABELS unit)
  endif()
  if(NOT A_TIMEOUT)
    set(A_TIMEOUT 300)
  endif()
  add_test(NAME ${A_NAME} COMMAND ${A_NAME})
  set_tests_properties(${A_NAME} PROPERTIES LABELS "${A_LABELS}" TIMEOUT ${A_TIMEOUT}
    ENVIRONMENT "UCP_SOURCE_DIR=${UCP_SOURCE_ROOT};UCP_BINARY_DIR=${CMAKE_BINARY_DIR}")
endfunction()
