package jumpstarter

import (
	"context"
	"io"
)

// DriverVNC is the child driver of a target with a display (Config.Display).
const DriverVNC = "vnc"

// Displayer is a Target with a display: the vnc child (upstream's
// UnixNetwork on QEMU's VNC socket, client class NetworkClient, so
// QemuClient.novnc() works) streams it.
type Displayer interface {
	// Display opens a connection to the target's VNC server (RFB protocol
	// bytes both ways). A powered-off target fails with a clear error.
	Display(ctx context.Context) (io.ReadWriteCloser, error)
}
