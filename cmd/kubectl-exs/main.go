// Command kubectl-exs is a kubectl plugin (`kubectl exs ...`) that leases,
// releases and lists the pods of ExporterSets by the label protocol of
// docs/exporterset.md. The logic is in internal/exs; this is wiring:
// flags, kubeconfig loading (as kubectl: KUBECONFIG, --kubeconfig,
// --context, -n/--namespace, ...) and output.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/internal/exs"
)

var version = "dev"

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := newCommand(os.Stdout, os.Stderr).ExecuteContext(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
}

// newCommand builds the command tree writing to out and errOut.
func newCommand(out, errOut io.Writer) *cobra.Command {
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	overrides := &clientcmd.ConfigOverrides{}
	root := &cobra.Command{
		Use:           "kubectl-exs",
		Short:         "Lease, release and list the pods of ExporterSets",
		Long:          "Lease, release and list the pods (virtual test targets) of qemu-kubelet ExporterSets by their label protocol (docs/exporterset.md).",
		Version:       version,
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.SetOut(out)
	root.SetErr(errOut)
	root.PersistentFlags().StringVar(&rules.ExplicitPath, "kubeconfig", "", "path to the kubeconfig file (default: $KUBECONFIG, ~/.kube/config)")
	clientcmd.BindOverrideFlags(overrides, root.PersistentFlags(), clientcmd.RecommendedConfigOverrideFlags(""))

	newClient := func() (*exs.Client, error) {
		cc := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, overrides)
		cfg, err := cc.ClientConfig()
		if err != nil {
			return nil, fmt.Errorf("load kubeconfig: %w", err)
		}
		ns, _, err := cc.Namespace()
		if err != nil {
			return nil, fmt.Errorf("namespace from kubeconfig: %w", err)
		}
		scheme := runtime.NewScheme()
		if err := errors.Join(clientgoscheme.AddToScheme(scheme), v1alpha1.AddToScheme(scheme)); err != nil {
			return nil, err
		}
		c, err := client.NewWithWatch(cfg, client.Options{Scheme: scheme})
		if err != nil {
			return nil, fmt.Errorf("API client: %w", err)
		}
		return &exs.Client{C: c, Namespace: ns, Progress: errOut}, nil
	}

	host, _ := os.Hostname()
	defaultHolder := exs.DefaultHolder(os.Getenv("USER"), host)
	root.PersistentFlags().String("holder", defaultHolder, "who holds the lease: the value of the qemu-kubelet.io/leased-by label")

	root.AddCommand(leaseCommand(out, newClient), releaseCommand(out, newClient), listCommand(out, errOut, newClient))
	return root
}

// leaseCommand is `kubectl exs lease SET`.
func leaseCommand(out io.Writer, newClient func() (*exs.Client, error)) *cobra.Command {
	var lo exs.LeaseOptions
	var timeout time.Duration
	var output string
	lease := &cobra.Command{
		Use:   "lease SET",
		Short: "Claim a free pod of an ExporterSet",
		Long: `Claim a Ready, unleased pod of the ExporterSet SET: label it qemu-kubelet.io/leased-by=HOLDER
and qemu-kubelet.io/used=true with the resourceVersion read as precondition, so that of
concurrent clients exactly one gets each pod. Prints the pod, its node and IP and how to
reach it. --for makes the controller end the lease after DURATION (the pod is then
recycled as on release). --wait waits (watching, not polling) until a pod is free.`,
		Example: `  kubectl exs lease rpi4
  kubectl exs lease rpi4 --for 30m --wait --timeout 10m
  pod=$(kubectl exs lease rpi4 -o name)`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if output != "" && output != "name" {
				return fmt.Errorf("--output %q: supported: name", output)
			}
			if timeout != 0 && !lo.Wait {
				return fmt.Errorf("--timeout needs --wait")
			}
			if timeout < 0 {
				return fmt.Errorf("--timeout %s: must not be negative", timeout)
			}
			lo.Holder, _ = cmd.Flags().GetString("holder")
			c, err := newClient()
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			if timeout > 0 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeoutCause(ctx, timeout, fmt.Errorf("--timeout %s reached", timeout))
				defer cancel()
			}
			p, set, err := c.Lease(ctx, args[0], lo)
			if err != nil {
				return err
			}
			if output == "name" {
				fmt.Fprintln(out, "pod/"+p.Name)
				return nil
			}
			exs.WriteLeased(out, p, set.Name, lo.Holder, time.Now())
			return nil
		},
	}
	lease.Flags().DurationVar(&lo.For, "for", 0, "end the lease after this long (e.g. 30m); default: until released")
	lease.Flags().BoolVar(&lo.Wait, "wait", false, "wait until a pod is free instead of failing")
	lease.Flags().DurationVar(&timeout, "timeout", 0, "with --wait: give up after this long (default: wait forever)")
	lease.Flags().StringVarP(&output, "output", "o", "", "output format: name (pod/NAME only)")
	return lease
}

// releaseCommand is `kubectl exs release POD`.
func releaseCommand(out io.Writer, newClient func() (*exs.Client, error)) *cobra.Command {
	var ro exs.ReleaseOptions
	release := &cobra.Command{
		Use:   "release POD",
		Short: "End the lease of a pod",
		Long: `Remove the lease label of POD (with its resourceVersion as precondition). The ExporterSet's
controller then recycles the pod by the set's recyclePolicy: Replace deletes it and boots a
fresh one, Reuse returns it to the warm buffer. A pod leased by another holder is released
only with --force (or --holder naming that holder).`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ro.Holder, _ = cmd.Flags().GetString("holder")
			c, err := newClient()
			if err != nil {
				return err
			}
			p, holder, set, err := c.Release(cmd.Context(), args[0], ro)
			if err != nil {
				return err
			}
			fmt.Fprintf(out, "Released pod %s (held by %s).", p.Name, holder)
			switch {
			case set == nil:
				fmt.Fprintln(out, " Its exporterset is gone.")
			case set.Spec.RecyclePolicy == v1alpha1.RecyclePolicyReuse:
				fmt.Fprintf(out, " Exporterset %s (recyclePolicy Reuse) returns it to the warm buffer.\n", set.Name)
			default:
				fmt.Fprintf(out, " Exporterset %s (recyclePolicy Replace) deletes it and boots a fresh one.\n", set.Name)
			}
			return nil
		},
	}
	release.Flags().BoolVar(&ro.Force, "force", false, "release even if another holder leased the pod")
	return release
}

// listCommand is `kubectl exs list [SET]`.
func listCommand(out, errOut io.Writer, newClient func() (*exs.Client, error)) *cobra.Command {
	list := &cobra.Command{
		Use:   "list [SET]",
		Short: "Table of ExporterSets, their free and leased pods, holders and ages",
		Args:  cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := newClient()
			if err != nil {
				return err
			}
			name := ""
			if len(args) == 1 {
				name = args[0]
			}
			sets, err := c.List(cmd.Context(), name)
			if err != nil {
				return err
			}
			if len(sets) == 0 {
				fmt.Fprintf(errOut, "No exportersets in namespace %s.\n", c.Namespace)
				return nil
			}
			return exs.WriteList(out, sets, time.Now())
		},
	}
	return list
}
