package jumpstarter_test

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/emptypb"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/pb"
)

// TestFlashAndDumpLogStream: a client's LogStream says what a file flash
// and a dump are doing, as upstream's carries its driver's output: where
// the image comes from, the target's own steps, the dump's progress by
// tenths (not per block), done with the size, and a failure with its
// reason (ERROR).
func TestFlashAndDumpLogStream(t *testing.T) {
	disk, target := withDisk(jumpstarter.ResourceOptions{})
	_, s, uuidOf := leased(t, func(c *jumpstarter.Config) {
		c.Logs = jumpstarter.NewLogBook()
		disk(c)
	})
	ctx := ctxT(t, 30*time.Second)
	logs, err := s.Exporter.LogStream(ctx, &emptypb.Empty{})
	require.NoError(t, err)
	fl := uuidOf("flasher")
	img := randomImage(t, 1<<20)
	require.NoError(t, s.Flash(ctx, fl, bytes.NewReader(img), "root", ""))
	var back bytes.Buffer
	require.NoError(t, s.Dump(ctx, fl, &back, "root", ""))
	require.True(t, bytes.Equal(img, back.Bytes()))
	err = s.Flash(ctx, fl, bytes.NewReader(randomImage(t, 2<<20)), "bios", "")
	require.ErrorContains(t, err, "larger than partition bios")
	_, writes := target().part("bios")
	assert.Zero(t, writes)

	var got []*pb.LogStreamResponse
	for len(got) == 0 || !strings.HasPrefix(got[len(got)-1].GetMessage(), "flash bios: failed") {
		r, err := logs.Recv()
		require.NoError(t, err)
		got = append(got, r)
	}
	var msgs []string
	for _, r := range got[1:] { // after "lease ... assigned"
		msgs = append(msgs, r.GetMessage())
		if strings.HasPrefix(r.GetMessage(), "flash ") || strings.HasPrefix(r.GetMessage(), "dump ") {
			assert.Equal(t, pb.LogSource_LOG_SOURCE_DRIVER, r.GetSource(), r.GetMessage())
			assert.Equal(t, "flasher", r.GetDriverType(), r.GetMessage())
		}
	}
	require.GreaterOrEqual(t, len(msgs), 8, "%q", msgs)
	assert.Regexp(t, `^flash root: receiving the image from client stream \S+ \(raw\)$`, msgs[0])
	assert.Equal(t, "flash", got[1].GetOperation())
	assert.Equal(t, []string{"flash root: installing 1048576 bytes", "flash root: done: 1.0 MiB flashed"}, msgs[1:3])
	assert.Regexp(t, `^dump root: sending 1.0 MiB to client stream \S+$`, msgs[3])
	// The dump's progress: by tenths of its size (how many depends on the
	// writes the copy makes: one here), the last at 100%.
	done := 4
	for done < len(msgs) && msgs[done] != "dump root: done: 1.0 MiB sent" {
		assert.Regexp(t, `^dump root: sent [0-9.]+ MiB of 1.0 MiB \([0-9]+%\)$`, msgs[done])
		done++
	}
	require.Less(t, done, len(msgs), "dump root: done, in %q", msgs)
	assert.LessOrEqual(t, done-4, 10, "at most a line per tenth: %q", msgs)
	assert.Equal(t, "dump root: sent 1.0 MiB of 1.0 MiB (100%)", msgs[done-1])
	assert.Regexp(t, `^flash bios: receiving the image from client stream \S+ \(raw\)$`, msgs[done+1])
	last := got[len(got)-1]
	assert.Equal(t, "ERROR", last.GetSeverity())
	assert.Contains(t, last.GetMessage(), "the image is larger than partition bios may hold (1048576 bytes)")
}
