// The chat page served at `/` (src/server/web/chat.html): plain HTML and JavaScript, compiled into the
// binary by src/server/CMakeLists.txt as one string, so the server needs no files next to it.
#pragma once

#include <string>

namespace kestrel::server {

const std::string& chat_page_html();

}  // namespace kestrel::server
