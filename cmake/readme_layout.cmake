# The README's "Layout" section is the table the build generates from the stages (build/layout.md, written at
# configure time by dcp_write_layout): between the markers "<!-- layout:begin -->" and "<!-- layout:end -->".
# Usage: cmake -DREADME=README.md -DLAYOUT=build/layout.md -DMODE=check|write -P cmake/readme_layout.cmake
# check fails (naming both files) when they differ; write puts the table into README.md.
file(READ ${README} readme)
file(READ ${LAYOUT} layout)
set(begin "<!-- layout:begin -->\n")
set(end "<!-- layout:end -->")
string(FIND "${readme}" "${begin}" b)
string(FIND "${readme}" "${end}" e)
if(b LESS 0 OR e LESS 0 OR e LESS b)
  message(FATAL_ERROR "${README}: no '<!-- layout:begin -->' ... '<!-- layout:end -->' section")
endif()
string(LENGTH "${begin}" blen)
math(EXPR from "${b} + ${blen}")
math(EXPR len "${e} - ${from}")
string(SUBSTRING "${readme}" ${from} ${len} current)
if(MODE STREQUAL "write")
  string(SUBSTRING "${readme}" 0 ${from} head)
  string(SUBSTRING "${readme}" ${e} -1 tail)
  file(WRITE ${README} "${head}${layout}${tail}")
  message(STATUS "wrote the Layout table into ${README}")
elseif(NOT current STREQUAL layout)
  message(FATAL_ERROR "README Layout is out of date: ${README} differs from the stages' table ${LAYOUT}; run "
                      "cmake -DREADME=README.md -DLAYOUT=build/layout.md -DMODE=write -P cmake/readme_layout.cmake")
else()
  message(STATUS "README Layout is current")
endif()
