package exs

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/duration"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
)

// SetView is one set and its pods, as List reads them.
type SetView struct {
	Set  v1alpha1.ExporterSet
	Pods []corev1.Pod // the pods the set controls
}

// Mode is "jumpstarter" for a set with spec.jumpstarter, else "standalone".
func Mode(set *v1alpha1.ExporterSet) string {
	if set.Spec.Jumpstarter != nil {
		return "jumpstarter"
	}
	return "standalone"
}

func policy(set *v1alpha1.ExporterSet) string {
	if set.Spec.RecyclePolicy == "" {
		return string(v1alpha1.RecyclePolicyReplace)
	}
	return string(set.Spec.RecyclePolicy)
}

// WriteList writes the table of `kubectl exs list`: one row per set (pods,
// free, leased, others, mode, policy), then one row per pod of the
// standalone sets (state, holder, lease age, expiry, node, pod age).
// Jumpstarter-mode sets count from their status (their leases are
// Jumpstarter's: `jmp get leases`).
func WriteList(w io.Writer, sets []SetView, now time.Time) error {
	tw := tabwriter.NewWriter(w, 0, 0, 3, ' ', 0)
	fmt.Fprintln(tw, "EXPORTERSET\tMODE\tPOLICY\tPODS\tFREE\tLEASED\tOTHER")
	for _, sv := range sets {
		s := &sv.Set
		if s.Spec.Jumpstarter != nil {
			st := s.Status
			fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%d\t%d\t%d\n", s.Name, Mode(s), policy(s), st.Replicas, st.AvailableReplicas, st.LeasedReplicas,
				max(st.Replicas-st.AvailableReplicas-st.LeasedReplicas, 0))
			continue
		}
		var free, leased, other int
		for i := range sv.Pods {
			switch Classify(&sv.Pods[i], now) {
			case Free:
				free++
			case Leased:
				leased++
			default:
				other++
			}
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%d\t%d\t%d\n", s.Name, Mode(s), policy(s), len(sv.Pods), free, leased, other)
	}
	var rows []string
	for _, sv := range sets {
		if sv.Set.Spec.Jumpstarter != nil {
			continue
		}
		for i := range sv.Pods {
			p := &sv.Pods[i]
			state := Classify(p, now)
			holder, leasedFor, expires := p.Labels[v1alpha1.LeaseLabel], "", ""
			if state == Leased || state == Expired {
				if t, ok := LeasedAt(p); ok {
					leasedFor = duration.HumanDuration(now.Sub(t))
				}
				if t, ok := Expiry(p); ok {
					if now.Before(t) {
						expires = "in " + duration.HumanDuration(t.Sub(now))
					} else {
						expires = duration.HumanDuration(now.Sub(t)) + " ago"
					}
				}
			}
			rows = append(rows, strings.Join([]string{sv.Set.Name, p.Name, string(state), dash(holder), dash(leasedFor), dash(expires),
				dash(p.Spec.NodeName), duration.HumanDuration(now.Sub(p.CreationTimestamp.Time))}, "\t"))
		}
	}
	if err := tw.Flush(); err != nil || len(rows) == 0 {
		return err
	}
	fmt.Fprintln(w)
	tw = tabwriter.NewWriter(w, 0, 0, 3, ' ', 0)
	fmt.Fprintln(tw, "EXPORTERSET\tPOD\tSTATE\tHOLDER\tLEASED\tEXPIRES\tNODE\tAGE")
	for _, r := range rows {
		fmt.Fprintln(tw, r)
	}
	return tw.Flush()
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// WriteLeased writes what a client needs after a claim: the pod, its node
// and IP, the expiry, and the kubectl commands that reach it (serial
// console, each declared guest port, release).
func WriteLeased(w io.Writer, p *corev1.Pod, set, holder string, now time.Time) {
	fmt.Fprintf(w, "Leased pod %s of exporterset %s as %s", p.Name, set, holder)
	if t, ok := Expiry(p); ok {
		fmt.Fprintf(w, " until %s (in %s)", t.UTC().Format(time.RFC3339), duration.HumanDuration(t.Sub(now)))
	} else {
		fmt.Fprint(w, " until released")
	}
	fmt.Fprintln(w, ".")
	fmt.Fprintf(w, "  node: %s  pod IP: %s\n", dash(p.Spec.NodeName), dash(p.Status.PodIP))
	ns := p.Namespace
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "  serial console:\tkubectl -n %s logs -f %s\t(interactive: kubectl -n %s attach -it %s)\n", ns, p.Name, ns, p.Name)
	for _, c := range p.Spec.Containers {
		for _, port := range c.Ports {
			if port.Protocol != "" && port.Protocol != corev1.ProtocolTCP {
				continue
			}
			what := fmt.Sprintf("guest port %d", port.ContainerPort)
			if port.Name != "" {
				what += " (" + port.Name + ")"
			}
			fmt.Fprintf(tw, "  %s:\tkubectl -n %s port-forward pod/%s %d:%d\t\n", what, ns, p.Name, port.ContainerPort, port.ContainerPort)
		}
	}
	fmt.Fprintf(tw, "  release:\tkubectl exs -n %s release %s\t\n", ns, p.Name)
	_ = tw.Flush()
}
