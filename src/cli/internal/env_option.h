// How every `shoal` command adds an option: the flag, its environment
// variable, its default shown in --help, and integers in plain decimal.
#pragma once

#include <string>
#include <type_traits>

#include <CLI/CLI.hpp>

namespace shoal::cli {

// CLI11 reads an integer as C's strtoll does: "010" is octal 8, "0x10" hex,
// and "-1" given to an unsigned option is its largest value (a
// --max-body-bytes of -1 would lift the body limit). Shoal's integer
// options take plain decimal, with a sign only where the type has one;
// leading zeros are dropped before CLI11 reads the text.
template <typename T>
CLI::Validator DecimalInteger() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        const size_t start = std::is_signed_v<T> && !text.empty() && text[0] == '-' ? 1 : 0;
        if (start == text.size() || text.find_first_not_of("0123456789", start) != std::string::npos) {
          return std::string(std::is_signed_v<T> ? "expects a decimal integer"
                                                 : "expects a decimal integer of 0 or more") +
                 ", got '" + text + "'";
        }
        const size_t digits = text.find_first_not_of('0', start);
        text.erase(start, (digits == std::string::npos ? text.size() - 1 : digits) - start);
        return "";
      },
      "");
}

template <typename T>
CLI::Option* EnvOption(CLI::App* app, const std::string& flag, T& value, const std::string& env,
                       const std::string& help) {
  CLI::Option* option = app->add_option(flag, value, help)->envname(env)->capture_default_str();
  if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) option->transform(DecimalInteger<T>());
  return option;
}

}  // namespace shoal::cli
