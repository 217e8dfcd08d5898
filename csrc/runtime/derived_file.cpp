#include "runtime/derived_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <ctime>

namespace pi {

SourceStamp stamp_of(const struct stat &st) {
    SourceStamp s;
    s.dev = uint64_t(st.st_dev);
    s.ino = uint64_t(st.st_ino);
    s.size = uint64_t(st.st_size);
    s.mtime_ns = int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
    s.ctime_ns = int64_t(st.st_ctim.tv_sec) * 1000000000 + st.st_ctim.tv_nsec;
    return s;
}

SourceStamp recordable(const SourceStamp &s) {
    timespec now{};
    clock_gettime(CLOCK_REALTIME, &now);
    const int64_t now_ns = int64_t(now.tv_sec) * 1000000000 + now.tv_nsec;
    return s.ctime_ns <= now_ns - kSettleNs ? s : SourceStamp{};
}

SourceMatch match_source(const SourceStamp &recorded, const SourceStamp &now, const std::function<bool()> &bytes_equal) {
    // no file has inode 0: a recorded stamp of none matches no source
    if (recorded.ino != 0 && recorded.dev == now.dev && recorded.ino == now.ino && recorded.size == now.size &&
        recorded.mtime_ns == now.mtime_ns && recorded.ctime_ns == now.ctime_ns)
        return SourceMatch::Stamp;
    return bytes_equal() ? SourceMatch::Bytes : SourceMatch::Changed;
}

void record_stamp(const std::string &path, uint64_t offset, const SourceStamp &now) {
    const SourceStamp stamp = recordable(now);
    if (stamp.ino == 0) return;
    const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC | O_NONBLOCK);  // regular (checked by the reader)
    if (fd < 0) return;
    ssize_t w;
    do w = ::pwrite(fd, &stamp, sizeof stamp, off_t(offset));
    while (w < 0 && errno == EINTR);
    ::close(fd);
}

}  // namespace pi
