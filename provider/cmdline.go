package provider

import "strings"

// DefaultConsole is the kernel console added to a directly booted kernel's
// command line when neither the image nor the pod names one: `kubectl logs`
// and `kubectl attach` are the VM's first serial port (qemu.Spec wires it
// to console.log and console.sock), and a kernel without console= writes
// nothing there.
const DefaultConsole = "console=ttyS0"

// KernelCmdline is the command line of a directly booted kernel: the
// image's, then the pod's annotation, with DefaultConsole first when
// neither names a console (a console= token before any "--", after which
// arguments go to init). Pure.
func KernelCmdline(image, extra string) string {
	cmd := strings.TrimSpace(strings.TrimSpace(image) + " " + strings.TrimSpace(extra))
	if hasConsoleArg(cmd) {
		return cmd
	}
	return strings.TrimSpace(DefaultConsole + " " + cmd)
}

// hasConsoleArg reports whether a kernel command line names a console for
// the kernel (console=..., before "--").
func hasConsoleArg(cmdline string) bool {
	for _, f := range strings.Fields(cmdline) {
		if f == "--" {
			return false
		}
		if strings.HasPrefix(f, "console=") {
			return true
		}
	}
	return false
}
