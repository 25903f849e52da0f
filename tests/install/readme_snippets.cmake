# README.md's C++ blocks that must compile as written, turned into one translation unit for the
# install test (install_test.cmake) at test time, so the README cannot drift from the library;
# and those of docs/*.md beside it (the README's sections that moved there, issue 59), read after
# README.md in name order, so that a marked block keeps being compiled wherever it moves.
#
# A block is marked by the line `<!-- compile: NAME (any note) -->` right before its ```cpp
# fence. Its leading #include lines go to the top of the file; the rest, verbatim, becomes the
# body of
#   template <typename Context> void NAME(Context& context)
# which first binds the names listed in readme_context_NAME below to the members of `context`.
# The struct readme_context::NAME (consumer/readme_context.h) gives those names values and is
# included after the snippets: the names are dependent, everything else in a block is looked up
# where the block stands, so a block compiles only if its own includes declare what it uses.
# #line directives point compiler messages at README.md (or the docs/ file holding the block).

# The names each marked block uses without declaring them.
set(readme_context_quickstart model x y loss_fn num_steps)
set(readme_context_mixed_precision model x y loss_fn num_steps)
set(readme_context_full_sharding model x y loss_fn num_steps group)
set(readme_context_virtual_groups conv_weights biases)
set(readme_context_training_checkpoint model x y loss_fn num_steps group)
set(readme_context_gradient_sharding model x y loss_fn num_steps group)
set(readme_context_lr_schedule model x y loss_fn num_steps)

# Writes `output` (a C++ file whose main() runs every marked block with its context) and sets
# `names_var` to the names of the blocks found, in README order, then those of docs/*.md.
function(shampoo_write_readme_snippets readme output names_var)
  get_filename_component(root "${readme}" DIRECTORY)
  file(GLOB docs LIST_DIRECTORIES false "${root}/docs/*.md")
  list(SORT docs)
  # At the start of a line, so prose may quote the marker.
  set(marker "\n<!-- compile: ")
  set(fence "```cpp\n")
  set(names "")
  set(count 0)
  foreach(document "${readme}" ${docs})
    file(READ "${document}" text)
    # How messages name the file: README.md, docs/<name>.md.
    file(RELATIVE_PATH shown "${root}" "${document}")
    set(offset 0)
    while(TRUE)
      string(SUBSTRING "${text}" ${offset} -1 rest)
      string(FIND "${rest}" "${marker}" at)
      if(at EQUAL -1)
        break()
      endif()
      math(EXPR at "${offset} + ${at} + 1")  # the marker's line, after its newline
      string(LENGTH "${marker}" marker_length)
      math(EXPR name_begin "${at} + ${marker_length} - 1")
      string(SUBSTRING "${text}" ${name_begin} -1 rest)
      string(REGEX MATCH "^([A-Za-z_][A-Za-z0-9_]*)[^\n]*-->\n" header "${rest}")
      if(NOT header)
        _shampoo_readme_line(line "${text}" ${at})
        message(FATAL_ERROR "${shown}:${line}: expected `<!-- compile: NAME ... -->` (NAME a C++ "
                            "identifier) on a line of its own")
      endif()
      set(name "${CMAKE_MATCH_1}")
      if(name IN_LIST names)
        _shampoo_readme_line(line "${text}" ${at})
        message(FATAL_ERROR "${shown}:${line}: a block named `${name}` is marked twice (names are "
                            "one per block, in README.md and docs/*.md together)")
      endif()
      if(NOT DEFINED readme_context_${name})
        _shampoo_readme_line(line "${text}" ${at})
        message(FATAL_ERROR "${shown}:${line}: block `${name}` has no context in "
                            "tests/install/readme_snippets.cmake (readme_context_${name}) and "
                            "consumer/readme_context.h (readme_context::${name})")
      endif()
      string(LENGTH "${header}" header_length)
      math(EXPR block_begin "${name_begin} + ${header_length}")
      string(SUBSTRING "${text}" ${block_begin} -1 rest)
      string(FIND "${rest}" "${fence}" fence_at)
      if(NOT fence_at EQUAL 0)
        _shampoo_readme_line(line "${text}" ${at})
        message(FATAL_ERROR "${shown}:${line}: `<!-- compile: ${name} -->` must be followed by a "
                            "```cpp fence on the next line")
      endif()
      string(LENGTH "${fence}" fence_length)
      math(EXPR code_begin "${block_begin} + ${fence_length}")
      string(SUBSTRING "${text}" ${code_begin} -1 rest)
      string(FIND "${rest}" "\n```" code_length)
      if(code_length EQUAL -1)
        message(FATAL_ERROR "${shown}: block `${name}` has no closing fence")
      endif()
      math(EXPR code_length "${code_length} + 1")  # with its last newline
      string(SUBSTRING "${text}" ${code_begin} ${code_length} code)
      math(EXPR offset "${code_begin} + ${code_length}")
      _shampoo_readme_line(line "${text}" ${code_begin})

      # Leading #include lines (and blank lines between them), each with its README line.
      set(block_${count}_includes "")
      while(code MATCHES "^(#include[^\n]*\n|[ \t]*\n)")
        set(first "${CMAKE_MATCH_1}")
        if(first MATCHES "^#include")
          string(APPEND block_${count}_includes "#line ${line} \"${document}\"\n${first}")
        endif()
        string(LENGTH "${first}" first_length)
        string(SUBSTRING "${code}" ${first_length} -1 code)
        math(EXPR line "${line} + 1")
      endwhile()
      set(block_${count}_name "${name}")
      set(block_${count}_file "${document}")
      set(block_${count}_line ${line})
      set(block_${count}_code "${code}")
      list(APPEND names "${name}")
      math(EXPR count "${count} + 1")
    endwhile()
  endforeach()

  # The generated parts say where they are in `output`, so that messages about them are not
  # attributed to README.md or a docs/ file.
  set(content "")
  _shampoo_append_generated("// Generated at test time from ${readme}
// by tests/install/readme_snippets.cmake: the blocks marked <!-- compile: NAME -->, verbatim.
")
  set(calls "")
  set(functions "")
  if(count GREATER 0)
    math(EXPR last "${count} - 1")
    foreach(i RANGE ${last})
      string(APPEND content "${block_${i}_includes}")
    endforeach()
    _shampoo_append_generated("\nnamespace readme {\n")
    foreach(i RANGE ${last})
      set(name "${block_${i}_name}")
      set(bindings "")
      foreach(bound IN LISTS readme_context_${name})
        string(APPEND bindings "  [[maybe_unused]] auto& ${bound} = context.${bound};\n")
      endforeach()
      _shampoo_append_generated("
template <typename Context>
void ${name}(Context& context) {
${bindings}")
      string(APPEND content "#line ${block_${i}_line} \"${block_${i}_file}\"\n${block_${i}_code}")
      _shampoo_append_generated("}\n")
      string(APPEND calls "  {
    readme_context::${name} context;
    readme::${name}(context);
    std::cout << \"readme snippet ${name}: ran\\n\";
  }
")
    endforeach()
    _shampoo_append_generated("\n}  // namespace readme\n")
  endif()
  _shampoo_append_generated("
#include \"readme_context.h\"

#include <iostream>

int main() {
${calls}  std::cout << \"readme snippets: ok\\n\";
  return 0;
}
")
  file(WRITE "${output}" "${content}")
  set(${names_var} "${names}" PARENT_SCOPE)
endfunction()

# Appends `generated` to the caller's `content` after a #line directive naming its place in the
# caller's `output`.
function(_shampoo_append_generated generated)
  string(REGEX REPLACE "[^\n]" "" newlines "${content}")
  string(LENGTH "${newlines}" line)
  math(EXPR line "${line} + 2")  # the line after the directive
  string(APPEND content "#line ${line} \"${output}\"\n${generated}")
  set(content "${content}" PARENT_SCOPE)
endfunction()

# Line number (1-based) of character `position` of `text`.
function(_shampoo_readme_line out text position)
  string(SUBSTRING "${text}" 0 ${position} before)
  string(REGEX REPLACE "[^\n]" "" newlines "${before}")
  string(LENGTH "${newlines}" count)
  math(EXPR count "${count} + 1")
  set(${out} ${count} PARENT_SCOPE)
endfunction()
