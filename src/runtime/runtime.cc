#include "runtime/runtime.h"

#include "runtime/null/null_runtime.h"
#include "runtime/ocr/tesseract_runtime.h"
#include "runtime/openai/openai_runtime.h"
#include "runtime/process/process_runtime.h"
#include "runtime/sim/sim_runtime.h"
#include "runtime/torch/torchscript_runtime.h"

namespace shoal {

Result<std::unique_ptr<Runtime>> CreateRuntime(const std::string& kind) {
  if (kind == "torchscript") {
    return std::unique_ptr<Runtime>(std::make_unique<TorchScriptRuntime>());
  }
  if (kind == "null") return std::unique_ptr<Runtime>(std::make_unique<NullRuntime>());
  if (kind == "process") return std::unique_ptr<Runtime>(std::make_unique<ProcessRuntime>());
  if (kind == "openai") return std::unique_ptr<Runtime>(std::make_unique<OpenAiRuntime>());
  if (kind == "sim") return std::unique_ptr<Runtime>(std::make_unique<SimRuntime>());
  if (kind == "tesseract") return std::unique_ptr<Runtime>(std::make_unique<TesseractRuntime>());
  return NotFound("unknown runtime '" + kind + "' (known: torchscript, process, openai, tesseract, sim, null)",
                  "runtime_not_found");
}

}  // namespace shoal
