#include "common/device.h"

#include <charconv>

namespace shoal {

Result<Device> ParseDevice(std::string_view text) {
  const auto bad = [&] {
    return InvalidArgument("bad device '" + std::string(text) + "': use cpu, cuda or cuda:N", "invalid_device");
  };
  if (text == "cpu") return Device{};
  if (text == "cuda") return Device{true, 0};
  constexpr std::string_view kPrefix = "cuda:";
  if (text.substr(0, kPrefix.size()) != kPrefix) return bad();
  const std::string_view digits = text.substr(kPrefix.size());
  int index = -1;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), index);
  if (digits.empty() || digits[0] < '0' || digits[0] > '9' || ec != std::errc() || end != digits.data() + digits.size() || index > 255)
    return bad();
  return Device{true, index};
}

}  // namespace shoal
