package exporter

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"strings"

	"github.com/qemu-kubelet/qemu-kubelet/qemu"
)

// Limits of qemu-img on an image a lease holder uploaded (as OpenStack
// runs it under prlimit): a crafted image must not make the node's
// qemu-img take its memory or CPU.
const (
	inspectMaxAddressSpace = 1 << 30 // bytes of address space
	inspectMaxCPUSeconds   = 30
	inspectMaxOutput       = 1 << 20
)

// inspectCommand is what inspectUpload runs under the limits (tests
// replace it).
var inspectCommand = []string{qemu.QEMUImgBinary, "info", "--output=json", "-U", "/dev/fd/3"}

// inspectUpload runs qemu-img info on the open file f under those limits
// (set by the shell's ulimit in the child before it execs qemu-img). The
// child gets f itself as its fd 3 and opens /dev/fd/3: no path a link
// could redirect.
func inspectUpload(ctx context.Context, f *os.File) (qemu.ImageInfo, error) {
	var info qemu.ImageInfo
	script := fmt.Sprintf(`ulimit -v %d && ulimit -t %d && exec "$0" "$@"`, inspectMaxAddressSpace>>10, inspectMaxCPUSeconds)
	cmd := exec.CommandContext(ctx, "/bin/sh", append([]string{"-c", script}, inspectCommand...)...)
	cmd.ExtraFiles = []*os.File{f}
	var stdout, stderr limitedBuffer
	stdout.max, stderr.max = inspectMaxOutput, 64<<10
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		msg := strings.TrimSpace(stderr.String())
		if ee, ok := err.(*exec.ExitError); ok && ee.ProcessState != nil && !ee.ProcessState.Exited() {
			msg = fmt.Sprintf("%s (killed: qemu-img runs on uploads with at most %d MiB of address space and %d s of CPU) %s", ee.ProcessState, inspectMaxAddressSpace>>20, inspectMaxCPUSeconds, msg)
		}
		return info, fmt.Errorf("qemu-img info: %w: %s", err, msg)
	}
	if stdout.over {
		return info, fmt.Errorf("qemu-img info: more than %d bytes of output", inspectMaxOutput)
	}
	if err := json.Unmarshal(stdout.Bytes(), &info); err != nil {
		return info, fmt.Errorf("qemu-img info: decode: %w", err)
	}
	return info, nil
}

// limitedBuffer keeps the first max bytes written to it.
type limitedBuffer struct {
	bytes.Buffer
	max  int
	over bool
}

func (b *limitedBuffer) Write(p []byte) (int, error) {
	n := len(p)
	if room := b.max - b.Len(); len(p) > room {
		b.over = true
		p = p[:max(room, 0)]
	}
	b.Buffer.Write(p)
	return n, nil
}
